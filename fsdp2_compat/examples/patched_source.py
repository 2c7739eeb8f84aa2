"""The source diffs in ``patches/`` as an oracle for the runtime patches.

Three parts, used by ``tests/test_diffs.py``:

- reading and applying unified diffs in pure Python (``parse_diff``,
  ``check_diff``, ``apply_diff``), with failures that name the diff, the
  file and the hunk, and show the first line that differs;
- released upstream sources (``package_root``, ``download_wheel``,
  ``extract_wheel``, ``copy_installed_package``);
- rank functions that run the *patched upstream source* (a tree that comes
  first on ``PYTHONPATH``, no runtime patch) or the installed release with
  the runtime patches, and report the same facts for both: the FSDP2 units
  ``apply_fsdp2`` creates (``wrap_units``) and the fused-forward losses and
  gradients against an unsharded reference (``fused_lm_head``).

Stdlib only at import time; torch and upstream are imported by the rank
functions.
"""

import os
import re
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = os.path.join(REPO, "patches")

# distribution -> top-level package in its wheel
PACKAGES = {"verl": "verl", "skyrl": "skyrl", "skyrl-train": "skyrl_train"}
RESULT_MARK = "@@fsdp2-compat-jobs@@"


# ---------------------------------------------------------------------------
# unified diffs


class DiffError(Exception):
    """A diff does not apply; the message names the diff, file and hunk."""


class Hunk:
    __slots__ = ("number", "header", "old_start", "old_len", "new_start", "new_len", "lines")

    def __init__(self, number, header, old_start, old_len, new_start, new_len):
        self.number = number
        self.header = header
        self.old_start = old_start
        self.old_len = old_len
        self.new_start = new_start
        self.new_len = new_len
        self.lines = []  # (tag, text) with tag in " -+"

    @property
    def old(self):
        return [text for tag, text in self.lines if tag in " -"]

    @property
    def new(self):
        return [text for tag, text in self.lines if tag in " +"]


class FileDiff:
    __slots__ = ("path", "hunks")

    def __init__(self, path):
        self.path = path
        self.hunks = []


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@(.*)$")


def _strip(path, strip):
    path = path.split("\t", 1)[0].strip()
    return path.split("/", strip)[-1] if strip else path


def parse_diff(text, strip=1):
    """``[FileDiff]`` of a unified diff; text before the first ``---`` is a comment."""
    files, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            current = FileDiff(_strip(lines[i + 1][4:], strip))
            files.append(current)
            i += 2
            continue
        match = _HUNK.match(line)
        if match and files:
            old_start, old_len, new_start, new_len, header = match.groups()
            hunk = Hunk(
                len(files[-1].hunks) + 1,
                line,
                int(old_start),
                1 if old_len is None else int(old_len),
                int(new_start),
                1 if new_len is None else int(new_len),
            )
            files[-1].hunks.append(hunk)
            i += 1
            while i < len(lines) and (len(hunk.old) < hunk.old_len or len(hunk.new) < hunk.new_len):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                tag, rest = (body[:1] or " "), body[1:]
                if tag not in " -+":
                    raise DiffError("malformed hunk %s in %s: line %r" % (hunk.header, current.path, body))
                hunk.lines.append((tag, rest))
                i += 1
            continue
        i += 1
    if not files:
        raise DiffError("no file diffs found")
    return files


def _stated(hunk, offset=0):
    """0-based index where ``hunk``'s old lines start, shifted by ``offset``."""
    return (hunk.old_start - 1 if hunk.old_len else hunk.old_start) + offset


def _locate(source, hunk, offset):
    """Index where ``hunk.old`` matches ``source`` exactly, nearest to its stated place; None if nowhere."""
    old = hunk.old
    last = len(source) - len(old)
    if last < 0:
        return None
    want = min(max(_stated(hunk, offset), 0), last)
    for delta in range(0, max(want, last - want) + 1):
        for pos in (want - delta, want + delta) if delta else (want,):
            if 0 <= pos <= last and source[pos : pos + len(old)] == old:
                return pos
    return None


def _first_difference(source, hunk, offset):
    start = max(_stated(hunk, offset), 0)
    for k, expected in enumerate(hunk.old):
        found = source[start + k] if start + k < len(source) else "<end of file>"
        if found != expected:
            return "line %d: expected %r, found %r" % (start + k + 1, expected, found)
    return "context matches at the stated line but not as a whole"


def _where(diff_name, fd, hunk, label):
    return "%s: hunk #%d (%s) of %s does not apply to %s" % (
        diff_name,
        hunk.number,
        hunk.header,
        fd.path,
        label,
    )


def check_diff(diff_path, root, label=None, exact=False):
    """Check that the diff at ``diff_path`` applies (``patch -p1`` from ``root``).

    Returns ``{file: [(hunk number, offset), ...]}``.  Raises ``DiffError``
    naming the diff, file and hunk (and the first differing line) when a hunk's
    context is not found; with ``exact`` a hunk that only applies at an
    offset is an error too (the diff was made against another release).
    """
    patched = apply_diff(diff_path, root, label=label, exact=exact, write=False)
    return {path: offsets for path, (_, offsets) in patched.items()}


def apply_diff(diff_path, root, label=None, exact=False, write=True):
    """Apply the diff to the tree at ``root`` (all files or none); see ``check_diff``."""
    with open(diff_path, encoding="utf-8") as f:
        files = parse_diff(f.read())
    label = label or root
    diff_name = os.path.relpath(diff_path, REPO) if diff_path.startswith(REPO) else diff_path
    results = {}
    for fd in files:
        target = os.path.join(root, fd.path)
        if not os.path.isfile(target):
            raise DiffError("%s: %s does not exist in %s" % (diff_name, fd.path, label))
        with open(target, encoding="utf-8") as f:
            text = f.read()
        source = text.splitlines()
        offset, offsets, out, cursor = 0, [], [], 0
        for hunk in fd.hunks:
            pos = _locate(source, hunk, offset)
            if pos is None or pos < cursor:
                raise DiffError(
                    "%s: %s" % (_where(diff_name, fd, hunk, label), _first_difference(source, hunk, offset))
                )
            stated = _stated(hunk, offset)
            if exact and pos != stated:
                raise DiffError(
                    "%s: its context is found %+d lines away from line %d: the diff was made against "
                    "another release" % (_where(diff_name, fd, hunk, label), pos - stated, stated + 1)
                )
            offset = pos - _stated(hunk)
            offsets.append((hunk.number, offset))
            out.extend(source[cursor:pos])
            out.extend(hunk.new)
            cursor = pos + len(hunk.old)
        out.extend(source[cursor:])
        results[fd.path] = ("\n".join(out) + ("\n" if text.endswith("\n") else ""), offsets)
    if write:
        for path, (new_text, _) in results.items():
            with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                f.write(new_text)
    return results


def gnu_patch_check(diff_path, root):
    """``patch -p1 --dry-run`` from ``root``: (ok, output), or None when GNU patch is missing."""
    exe = shutil.which("patch")
    if exe is None:
        return None
    with open(diff_path, "rb") as f:
        proc = subprocess.run(
            [exe, "-p1", "--dry-run", "--batch", "--force", "-F0", "-d", root],
            stdin=f,
            capture_output=True,
            timeout=60,
        )
    return proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")


def diff_files(diff_path):
    with open(diff_path, encoding="utf-8") as f:
        return [fd.path for fd in parse_diff(f.read())]


# ---------------------------------------------------------------------------
# released sources


def package_root(dist):
    """The directory holding the installed top-level package of ``dist`` (no import), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(PACKAGES[dist])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def download_wheel(dist, version, cache_dir, timeout=180):
    """``pip download --no-deps dist==version`` into ``cache_dir`` (reused); the wheel path.

    Raises ``RuntimeError`` with pip's output when the download fails.
    """
    os.makedirs(cache_dir, exist_ok=True)
    stem = "%s-%s-" % (PACKAGES[dist], version)
    found = [n for n in os.listdir(cache_dir) if n.startswith(stem) and n.endswith(".whl")]
    if found:
        return os.path.join(cache_dir, sorted(found)[0])
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--ignore-requires-python",
           "-q", "-d", cache_dir, "%s==%s" % (dist, version)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError("%s failed: %s" % (" ".join(cmd), exc)) from None
    found = [n for n in os.listdir(cache_dir) if n.startswith(stem) and n.endswith(".whl")]
    if proc.returncode != 0 or not found:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd[2:]), proc.returncode, " | ".join(tail)))
    return os.path.join(cache_dir, sorted(found)[0])


def extract_wheel(wheel, dest):
    """Unzip the package sources of ``wheel`` into ``dest`` (once); returns ``dest``."""
    marker = os.path.join(dest, ".extracted")
    if not os.path.exists(marker):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(dest, [n for n in zf.namelist() if ".dist-info/" not in n])
        open(marker, "w").close()
    return dest


def copy_installed_package(dist, dest):
    """Copy the installed package of ``dist`` to ``dest/<package>``; returns ``dest``."""
    root = package_root(dist)
    if root is None:
        raise RuntimeError("%s is not installed" % dist)
    pkg = PACKAGES[dist]
    shutil.copytree(
        os.path.join(root, pkg), os.path.join(dest, pkg), ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    return dest


# ---------------------------------------------------------------------------
# rank functions (run through fsdp2_compat.examples.ranks.run_ranks)


def _check_mode(tree, patches, modules):
    """Source mode: modules come from ``tree`` and nothing of fsdp2-compat is applied."""
    from fsdp2_compat import engine

    info = {"requested": list(engine.requested()), "files": {}}
    for module in modules:
        info["files"][module.__name__] = module.__file__
    if tree is not None:
        bad = [m.__name__ for m in modules if not os.path.realpath(m.__file__).startswith(os.path.realpath(tree))]
        if bad or engine.requested() or engine._replacements:
            raise RuntimeError("not a clean patched-source run: %r, requested %r" % (bad, engine.requested()))
    return info


def wrap_units(rank, world, framework, families, tree=None, patches=None, unpatched=()):
    """Per family and tying, the FSDP2 units the framework's ``apply_fsdp2`` creates.

    ``tree``: the upstream package is imported from this patched source tree
    (checked); ``patches``: runtime patches to apply first (``"all"`` for all);
    ``unpatched``: families whose plan is also recorded before the runtime
    patches are applied (to show the comparison can tell fix from upstream).
    Returns ``{"units": {"<family>/<tie variant>": [...] or "error: ..."}, "unpatched": {...},
    "mode": {...}}`` (tie variants: ``TIE_VARIANTS``).
    """
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2_compat
    from fsdp2_compat.examples import tiny_models
    from fsdp2_compat.examples.scenarios import _first_line, import_fsdp_utils, wrapped_module_names

    fsdp_utils = import_fsdp_utils(framework)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))

    def plan(families):
        out = {}
        for family in families:
            for tie in TIE_VARIANTS:
                model = tiny_models.build(family, tie=_TIE_ARG[tie])
                key = "%s/%s" % (family, tie)
                try:
                    fsdp_utils.apply_fsdp2(model, {"mesh": mesh}, {})
                    out[key] = wrapped_module_names(model)
                except Exception as exc:
                    out[key] = "error: %s: %s" % (type(exc).__name__, _first_line(exc))
        return out

    result = {"unpatched": plan(unpatched)}
    if patches:
        fsdp2_compat.apply(None if patches == "all" else patches)
    result["mode"] = _check_mode(tree, patches, [fsdp_utils])
    result["units"] = plan(families)
    return result


# variant label -> tiny_models.build(tie=...)
_TIE_ARG = {"untied": False, "tied": True, "tied-weights-only": "weights-only"}
TIE_VARIANTS = tuple(_TIE_ARG)


# verl model module -> module-level function its fused forwards call for the
# backbone (stubbed in the harness: verl's vision forwards need real-size
# checkpoints' processors), or None when they call ``self.model`` directly.
FUSED_MODULES = {
    "qwen3_vl": None,
    "glm4v": "glm4v_forward",
    "qwen2_vl": "qwen2_vl_forward",
    "dense_common": None,
    "qwen3_5": None,
}


def _text_batch(seed, batch_size=2, length=12):
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 240, (batch_size, length), generator=gen)
    mask = torch.ones(batch_size, length, dtype=torch.long)
    mask[0, -3:] = 0  # some padding, so the mask matters
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(length).expand(batch_size, -1)}


def _train_bound_forward(rank, world, model_module, steps=2, lr=0.05):
    """verl's ``<model_module>.forward_with_torch_backend`` bound to a tiny Qwen2 causal LM.

    The fused forward is installed as the model class's ``forward`` exactly as
    verl's ``patch_forward_with_backends`` does (module attribute read now, so a
    runtime patch or a patched source is what runs).  Backbones that verl calls
    through a module-level helper (GLM-4V, Qwen2-VL) are stubbed to the text
    backbone: the code under test is the read of ``lm_head.weight``.
    """
    import copy
    import importlib

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_compat.examples import tiny_models
    from fsdp2_compat.examples.scenarios import (
        _first_line,
        _full,
        _fused_loss,
        _rel_err,
        train_against_reference,
        wrapped_module_names,
    )
    from verl.utils import fsdp_utils

    module = importlib.import_module("verl.models.transformers." + model_module)
    stub = FUSED_MODULES[model_module]
    if stub is not None:
        setattr(module, stub, lambda self, input_ids, **kwargs: self.model(input_ids=input_ids, **kwargs))
    base = tiny_models.build("qwen2", tie=False, seed=0)
    cls = type("Fused%s" % model_module.title().replace("_", ""), (type(base),), {"forward": module.forward_with_torch_backend})
    base.__class__ = cls
    model, reference = base, copy.deepcopy(base)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    fsdp_utils.apply_fsdp2(model, {"mesh": mesh}, {})
    result = {
        "wrapped": wrapped_module_names(model),
        "error": None,
        "losses": [],
        "loss_err": 0.0,
        "grad_err": 0.0,
        "worst_grad": None,
        "lm_head_grad_err": 0.0,
        "param_err": 0.0,
    }

    def loss_of(module, batch):
        out = module(**batch, return_dict=True)
        return _fused_loss(out, batch), out

    def batches_for(step):
        return [_text_batch(seed=1 + step * world + r) for r in range(world)]

    train_against_reference(model, reference, rank, world, result, batches_for, loss_of, steps, lr)
    if result["error"] is not None:
        return result
    # Gradient accumulation: no reduce-scatter on the first micro-batch (as verl
    # does with several micro-batches per step), then one for both.
    micro = [[_text_batch(seed=50 + 10 * r + k) for k in range(2)] for r in range(world)]
    try:
        for k in range(2):
            model.set_requires_gradient_sync(k == 1)
            batch = micro[rank][k]
            (_fused_loss(model(**batch, return_dict=True), batch) / 2).backward()
        total = sum(_fused_loss(reference(**b, return_dict=True), b) for m in micro for b in m)
        (total / (2 * world)).backward()
        result["accum_grad_err"] = max(
            _rel_err(_full(p.grad), q.grad) for p, q in zip(model.parameters(), reference.parameters())
        )
    except Exception as exc:
        result["accum_error"] = "%s: %s" % (type(exc).__name__, _first_line(exc))
    model.zero_grad()
    reference.zero_grad()
    # Log-probs without autograd (rollout): must work and leave lm_head resharded.
    with torch.no_grad():
        try:
            model(**_text_batch(seed=99), return_dict=True)
            from torch.distributed.tensor import DTensor

            result["no_grad_resharded"] = isinstance(model.lm_head.weight, DTensor) or not hasattr(
                model.lm_head, "reshard"
            )
        except Exception as exc:
            result["no_grad_error"] = "%s: %s" % (type(exc).__name__, _first_line(exc))
    return result


def fused_lm_head(rank, world, model_modules, families=(), tree=None, patches=None, unpatched=()):
    """Fused-forward training on FSDP2 against an unsharded data-parallel reference.

    ``model_modules``: verl model modules whose ``forward_with_torch_backend``
    runs on a tiny Qwen2 (see ``_train_bound_forward``); ``families``: tiny
    families trained through verl's own ``apply_monkey_patch``
    (``scenarios.train_fused``).  ``tree`` / ``patches`` as in ``wrap_units``;
    ``unpatched``: model modules also run before the runtime patches.  Returns ``{"results": {name: result}, "unpatched": ..., "mode": ...}``.
    """
    import importlib

    import fsdp2_compat
    from fsdp2_compat.examples.scenarios import train_fused

    def run_all(model_modules, families):
        out = {}
        for name in model_modules:
            try:
                importlib.import_module("verl.models.transformers." + name)
            except ImportError as exc:  # e.g. qwen3_5 needs transformers 5
                out["module:" + name] = {"skipped": "%s: %s" % (type(exc).__name__, exc)}
                continue
            out["module:" + name] = _train_bound_forward(rank, world, name)
        for family in families:
            out["family:" + family] = train_fused(rank, world, family, None)
        return out

    result = {"unpatched": run_all(unpatched, ())}
    if patches:
        fsdp2_compat.apply(None if patches == "all" else patches)
    modules = [sys.modules["verl.models.transformers." + m] for m in model_modules
               if "verl.models.transformers." + m in sys.modules]
    modules.append(importlib.import_module("verl.utils.fsdp_utils"))
    result["mode"] = _check_mode(tree, patches, modules)
    result["results"] = run_all(model_modules, families)
    return result


def run_jobs(jobs):
    """Run ``[(name, rank function name, world, args)]`` with ``run_ranks``, one after another.

    Returns ``{name: {"result": per-rank results} or {"error": message}}``; a
    failing job does not stop the others.  Run in a fresh interpreter with a
    patched tree first on ``PYTHONPATH`` for the source side of the oracle.
    """
    import time

    from .ranks import run_ranks

    out = {}
    for name, fn_name, world, args in jobs:
        start = time.monotonic()
        try:
            out[name] = {"result": run_ranks(globals()[fn_name], world, *args)}
        except Exception as exc:
            out[name] = {"error": "%s: %s" % (type(exc).__name__, exc)}
        out[name]["seconds"] = round(time.monotonic() - start, 2)
    return out


def jobs_main():
    """``python -c "from fsdp2_compat.examples.patched_source import jobs_main; jobs_main()" JOBS_JSON``.

    Prints the results of ``run_jobs`` as one JSON line after ``RESULT_MARK``.
    (Not ``python -m``: rank functions must pickle by their module name.)
    """
    import json

    print(RESULT_MARK + json.dumps(run_jobs(json.loads(sys.argv[1]))))
