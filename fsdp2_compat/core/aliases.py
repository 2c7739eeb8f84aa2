"""Rebind names that other modules imported from a patched module.

Upstream callers do ``from verl.utils.fsdp_utils import apply_fsdp2`` at
module top, so replacing the attribute on ``fsdp_utils`` alone leaves their
copy pointing at the old function.  We find such copies by identity in the
``__dict__`` of every loaded module and swap them too, remembering each swap
so that revert can undo exactly what was done.

Module ``__dict__`` is read directly (not ``getattr``/``dir``) so that lazy
modules such as transformers' ``_LazyModule`` are never asked to import more.

Cost: a training process holds thousands of modules (torch, transformers and
a framework: ~3,400 modules, ~130,000 globals), and one scan of them takes
30-90 ms on a 2-core machine; the tests' rank processes apply and revert
patches hundreds of times.  So:
- the standard library and the packages every framework we patch is built on
  (``BELOW``: torch, numpy, sympy, ...; two thirds of those globals) are not read: none of them imports
  a framework, so none can hold an alias of a framework's function.  A package
  is read again when an original is its own (a torch function we replace);
- ``rebind_all`` serves any number of objects in one scan (the engine rebinds
  every target of one ``apply()`` or ``revert()`` together);
- the identity test runs in C (``set.isdisjoint`` over ``map(id, ...)``): only
  a module that holds one of the objects is walked in Python.
"""

import sys
import types
from collections import namedtuple

# One object to rebind: every global bound to ``original`` (but the ``(module name, attr)`` pairs of ``skip``)
# is pointed at ``replacement``.
Request = namedtuple("Request", "original replacement skip")
# One global rebound: ``namespace[key]`` of the module named ``module``.
Change = namedtuple("Change", "namespace module key")

# Top-level packages below every framework fsdp2-compat patches (verl, SkyRL, TRL, accelerate, AReaL,
# LLaMA-Factory, transformers): they never import one, so their globals cannot alias its functions.  The
# standard library, and the third-party libraries these stacks load (torch's, transformers' and the frameworks'
# own dependencies).  Not transformers or peft (they import accelerate), not a framework, never user code.
BELOW = frozenset(sys.stdlib_module_names) | frozenset((
    "torch", "torchgen", "functorch", "torchdata", "numpy", "sympy", "mpmath", "networkx", "triton", "jinja2",
    "markupsafe", "safetensors", "tokenizers", "huggingface_hub", "hf_xet", "yaml", "regex", "requests", "urllib3",
    "certifi", "charset_normalizer", "idna", "filelock", "fsspec", "packaging", "tqdm", "rich", "pygments",
    "markdown_it", "mdurl", "google", "pyarrow", "pandas", "dateutil", "pytz", "tzdata", "psutil", "ray",
    "tensordict", "pydantic", "pydantic_core", "typing_extensions", "typing_inspection", "annotated_types",
    "datasets", "dill", "multiprocess", "xxhash", "scipy", "PIL", "numba", "llvmlite", "einops", "openai",
    "aiohttp", "aiohappyeyeballs", "aiosignal", "aiofiles", "yarl", "multidict", "frozenlist", "propcache",
    "httpx", "httpx2", "httpcore", "httpcore2", "h11", "anyio", "sniffio", "flask", "werkzeug", "itsdangerous",
    "blinker", "click", "omegaconf", "hydra", "antlr4", "lark", "attr", "attrs", "jsonschema",
    "jsonschema_specifications", "referencing", "rpds", "tenacity", "colorlog", "uvloop", "orjson", "msgpack",
    "grpc", "cloudpickle", "websockets", "zmq", "setuptools", "pkg_resources", "_distutils_hack", "tabulate",
    "distro", "jiter", "_pytest", "pytest", "pluggy", "iniconfig", "execnet", "xdist",
))


def rebind_all(requests):
    """``rebind`` for several objects in one scan of ``sys.modules``.

    ``requests``: ``[Request(original, replacement, skip), ...]`` (plain triples are read the same way).
    Returns one list of ``Change`` per request, in order (each as ``rebind`` returns it).  The scan
    finds every alias before it changes one: if it raises, nothing changed.
    """
    requests = [Request(*r) for r in requests]
    wanted = {}  # id(original) -> indexes of its requests (the originals are alive: ids are stable)
    for index, request in enumerate(requests):
        wanted.setdefault(id(request.original), []).append(index)
    ids = set(wanted)
    own = {(getattr(r.original, "__module__", None) or "").partition(".")[0] for r in requests}
    below = BELOW - own
    found = []  # (request index, namespace, module name, key)
    for name, module in list(sys.modules.items()) if ids else ():
        if name.partition(".")[0] in below or not isinstance(module, types.ModuleType):
            continue
        namespace = module.__dict__
        try:
            if ids.isdisjoint(map(id, namespace.values())):
                continue
            hits = [(key, value) for key, value in namespace.items() if id(value) in ids]
        except RuntimeError:  # dict changed size: a module importing on another thread
            hits = [(key, value) for key, value in list(namespace.items()) if id(value) in ids]
        for key, value in hits:
            # the first request for this object that does not skip the name, as separate rebinds in order would
            index = next((i for i in wanted[id(value)]
                          if value is requests[i].original and (name, key) not in requests[i].skip), None)
            if index is not None:
                found.append((index, namespace, name, key))
    changes = [[] for _ in requests]
    for index, namespace, name, key in found:
        namespace[key] = requests[index].replacement
        changes[index].append(Change(namespace, name, key))
    return changes


def rebind(original, replacement, skip=()):
    """Point every global name bound to ``original`` at ``replacement``.

    ``skip`` holds ``(module_name, attr)`` pairs left alone (the seam itself).
    Returns the list of ``Change(module_dict, module_name, attr)`` that changed.
    """
    return rebind_all([Request(original, replacement, skip)])[0]


def restore(changed, original, replacement):
    """Undo ``rebind``; names rebound since by someone else are left alone."""
    kept = []
    for change in changed:
        if change.namespace.get(change.key) is replacement:
            change.namespace[change.key] = original
        else:
            kept.append("%s.%s" % (change.module, change.key))
    return kept
