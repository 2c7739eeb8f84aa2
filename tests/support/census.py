"""Release census: read target sources from every published release, without installing or importing them.

``releases(dist)`` lists a distribution's releases from the package
registry's JSON API; ``read_member(dist, version, path)`` returns the text of
one file of that release (``None`` when the release has no such file).  A
wheel is read with HTTP range requests (the zip's central directory and the
one member), so even torch's 100+ MB wheels cost a few MB each; an sdist is
downloaded whole.  Everything read is cached under ``.venv/census/``
(``FSDP2_CI_CENSUS_CACHE``; CI keeps it beside the venvs), and so is each
target's fingerprint in each release, so a second run asks the network for
nothing but the release lists and parses nothing it parsed before.

``classify(target, version, read)`` is the census verdict for one target in
one release: ``covered`` (its code matches a recorded fingerprint, whose label
includes the release), ``fixed`` (``fixed_in``), ``declared`` (a ``declared``
spec, with its reason), or a problem: ``unclassified`` (code or absence the
catalogue does not account for) or ``mislabelled`` (a fingerprint match whose
label does not include the release).

Failures to reach the registry raise ``CensusError`` naming the release.
"""

import functools
import io
import json
import os
import tarfile
import threading
import urllib.parse
import urllib.request
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.environ.get("FSDP2_CI_CENSUS_CACHE") or os.path.join(REPO, ".venv", "census")
INDEX = os.environ.get("FSDP2_CI_CENSUS_INDEX", "https://pypi.org/pypi")
TIMEOUT = 60
ABSENT = "\0absent\0"


class CensusError(RuntimeError):
    """A release could not be read; the message names it."""


def _get(url, headers=None):
    request = urllib.request.Request(url, headers=dict(headers or {}, **{"User-Agent": "fsdp2-compat-census"}))
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return response.read()


def releases(dist):
    """``{version: [file dicts]}`` of every published release of ``dist`` that has files."""
    url = "%s/%s/json" % (INDEX, dist)
    try:
        data = json.loads(_get(url))
    except Exception as exc:
        raise CensusError("cannot list the releases of %s from %s: %s: %s" % (dist, url, type(exc).__name__, exc))
    out = {}
    for version, files in data["releases"].items():
        if files:
            for f in files:
                f["url"] = urllib.parse.urljoin(url, f["url"])
            out[version] = files
    return out


def age_days(files, now=None):
    """Days since the first file of a release (``releases(dist)[version]``) was uploaded to the registry."""
    import datetime

    times = [datetime.datetime.fromisoformat(f["upload_time_iso_8601"].replace("Z", "+00:00"))
             for f in files if f.get("upload_time_iso_8601")]
    if not times:
        return float("inf")  # no upload time recorded: treat as long published (the census then fails on it)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return (now - min(times)).total_seconds() / 86400.0


def _pick(files):
    """The cheapest file to read a release's Python sources from: a pure wheel, any wheel, or the sdist."""
    wheels = [f for f in files if f["filename"].endswith(".whl")]
    pure = [f for f in wheels if f["filename"].endswith("-none-any.whl")]
    if pure:
        return pure[0]
    if wheels:
        return min(wheels, key=lambda f: f["size"])
    sdists = [f for f in files if f["filename"].endswith((".tar.gz", ".zip"))]
    if sdists:
        return sdists[0]
    raise CensusError("no wheel or sdist among %s" % [f["filename"] for f in files])


class _RemoteFile(io.RawIOBase):
    """A seekable read-only view of a URL, fetched with HTTP range requests in cached blocks."""

    BLOCK = 1 << 18

    def __init__(self, url, size):
        self.url, self.size, self.pos, self.blocks = url, size, 0, {}

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def _block(self, index):
        if index not in self.blocks:
            start = index * self.BLOCK
            end = min(self.size, start + self.BLOCK) - 1
            self.blocks[index] = _get(self.url, {"Range": "bytes=%d-%d" % (start, end)})
        return self.blocks[index]

    def read(self, n=-1):
        if n is None or n < 0:
            n = self.size - self.pos
        n = max(0, min(n, self.size - self.pos))
        out = bytearray()
        while len(out) < n:
            index, offset = divmod(self.pos + len(out), self.BLOCK)
            out += self._block(index)[offset:offset + n - len(out)]
        self.pos += len(out)
        return bytes(out)

    def readinto(self, buffer):
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


_archives = {}
_lock = threading.Lock()


def _members(dist, version, files):
    """``(names, read(name))`` of the release's archive."""
    key = (dist, version)
    with _lock:
        if key in _archives:
            return _archives[key]
    f = _pick(files)
    try:
        if f["filename"].endswith(".whl"):
            zf = zipfile.ZipFile(_RemoteFile(f["url"], f["size"]))
            names = zf.namelist()
            result = (names, lambda name: zf.read(name).decode("utf-8", "replace"))
        else:
            data = _get(f["url"])
            if f["filename"].endswith(".zip"):
                zf = zipfile.ZipFile(io.BytesIO(data))
                names = zf.namelist()
                result = (names, lambda name: zf.read(name).decode("utf-8", "replace"))
            else:
                tf = tarfile.open(fileobj=io.BytesIO(data))
                names = tf.getnames()
                result = (names, lambda name: tf.extractfile(name).read().decode("utf-8", "replace"))
    except CensusError:
        raise
    except Exception as exc:
        raise CensusError("cannot read %s %s (%s): %s: %s" % (dist, version, f["filename"], type(exc).__name__, exc))
    with _lock:
        _archives[key] = result
    return result


def module_paths(module):
    """Where ``module``'s source sits inside a package tree."""
    base = module.replace(".", "/")
    return (base + ".py", base + "/__init__.py")


_module_locks = {}


def read_module(dist, version, files, module):
    """The source text of ``module`` in ``dist`` ``version`` (``None`` if the release lacks it); cached.

    Several targets live in one module and the census reads them from threads:
    one lock per file, and the cache file is written whole before it appears
    (a half-written cache would read as code without the later definitions).
    """
    cached = os.path.join(CACHE, dist, version, module + ".py")
    with _lock:
        lock = _module_locks.setdefault(cached, threading.Lock())
    with lock:
        if os.path.exists(cached):
            text = open(cached, encoding="utf-8").read()
            return None if text == ABSENT else text
        names, read = _members(dist, version, files)
        text = None
        for path in module_paths(module):
            # Wheels hold the package at the root; sdists under NAME-VERSION/ (sometimes src/).
            hits = [n for n in names if n == path or n.endswith("/" + path)]
            if hits:
                text = read(min(hits, key=len))
                break
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        partial = cached + ".partial"
        with open(partial, "w", encoding="utf-8") as out:
            out.write(ABSENT if text is None else text)
        os.replace(partial, cached)
        return text


@functools.lru_cache(maxsize=None)
def _algorithm():
    """A hash of the fingerprinting code: cached fingerprints are valid only for the code that computed them."""
    import hashlib
    import inspect

    from fsdp2_compat.core import guards

    return hashlib.sha256(inspect.getsource(guards.fingerprint_source).encode()).hexdigest()[:16]


def _fingerprint(target, version, text):
    """``(fingerprint, None)`` or ``(None, why not)`` of ``target.attr`` in its module's ``text``; cached on disk
    beside the source (parsing a large modeling file is most of a census that reads nothing from the network)."""
    import hashlib

    from fsdp2_compat.core import guards

    path = os.path.join(CACHE, target.dist, version, target.module + ".fingerprints.json")
    algorithm = _algorithm()
    with _lock:
        lock = _module_locks.setdefault(path, threading.Lock())
    with lock:
        known = {}
        if os.path.exists(path):
            known = json.load(open(path, encoding="utf-8"))
            if known.get("algorithm") != algorithm:
                known = {}
        # keyed by the source too: a published release's file never changes, but a caller may classify other
        # text under the same release (tests/tooling/test_census_message.py's toy releases)
        key = "%s:%s" % (target.attr, hashlib.sha256(text.encode()).hexdigest()[:16])
        if key not in known:
            try:
                known[key] = [guards.fingerprint_source(text, target.attr), None]
            except (LookupError, SyntaxError, ValueError) as exc:
                known[key] = [None, str(exc)]
            known["algorithm"] = algorithm
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".partial", "w", encoding="utf-8") as out:
                json.dump(known, out)
            os.replace(path + ".partial", path)
        return tuple(known[key])


def _label_range(label):
    first, _, last = label.partition("-")
    return first, last or first


def classify(target, version, read):
    """``(verdict, detail)`` for ``target`` in release ``version``; ``read()`` returns its module's source.

    Releases that carry the fix or are declared are classified by the
    catalogue's word alone: their sources are not read.
    """
    from fsdp2_compat.core import guards, policy
    from packaging.version import Version

    if target.fixed_in and guards.in_range(version, target.fixed_in):
        return "fixed", "fixed upstream (%s)" % target.fixed_in
    reason = policy.declared_reason(target, version)
    if reason is not None:
        return "declared", reason
    reason = policy.unsupported_reason(target, version)
    if reason is not None:
        return "unsupported", reason
    text = read()
    if text is None:
        return "unclassified", "%s is not in this release, and no declared spec says so" % target.module
    fp, error = _fingerprint(target, version, text)
    if error is not None:
        return "unclassified", "%s.%s: %s" % (target.module, target.attr, error)
    # The same code may come back after a release that changed it (transformers' Qwen3-VL forward: 4.57.0-4.57.1,
    # other code in 4.57.2-4.57.3, the first again from 4.57.4): one label per stretch, any may cover the release.
    matching = [label for label, known in target.fingerprints.items() if known == fp]
    for label in matching:
        first, last = (Version(v) for v in _label_range(label))
        if first <= Version(version) <= last:
            return "covered", label
    if matching:
        return "mislabelled", "code of the %s release (fingerprint %s), but %s is outside that label" % (
            " / ".join(matching), fp, version)
    return "unclassified", "new code: fingerprint %s (recorded: %s)" % (
        fp, ", ".join("%s=%s" % kv for kv in target.fingerprints.items()))


def defined_in(target):
    """The repository path of the integration module that defines ``target`` (where a contributor edits it)."""
    import sys

    import fsdp2_compat.integrations  # noqa: F401  (imports every integration module)

    # Read which module holds the record (``transformers_media`` for transformers, ``skyrl`` for both SkyRL
    # dists); a module name guessed from a dist name misses those.
    for name in sorted(m for m in sys.modules if m.startswith("fsdp2_compat.integrations.")):
        module = sys.modules[name]
        found = [v for value in vars(module).values() for v in (value if isinstance(value, tuple) else (value,))]
        if any(getattr(v, "key", None) == target.key for v in found if isinstance(v, type(target))):
            return name.replace(".", "/") + ".py"
    return "fsdp2_compat/integrations/"


def what_to_do(target, version, verdict, detail):
    """One paragraph for a census problem: the release, the target, what was found and what a contributor does."""
    where = defined_in(target)
    head = "%s %s is not classified for target %s (%s, defined in %s): %s." % (
        target.dist, version, target.key, target.what, where, detail)
    if verdict == "mislabelled":
        label = next((lb for lb, fp in target.fingerprints.items() if fp in detail), None)
        first, last = _label_range(label) if label else ("?", "?")
        action = ("Its code is byte-for-byte a recorded release's. If it was published after %s, widen that label: "
                  "fingerprints={'%s-%s': ...} (the seam then applies there as 'applied, unproven' until a pinned "
                  "set in .ci/sets runs it; widen versions= once it does)." % (last, first, version))
    elif "is not in this release" in detail:
        action = ("The module is gone or moved. Find where the code now lives: record a new Target (same seam if "
                  "the code is the same), or declared={'>=%s': '<why nothing is to patch>'} if the bug went with "
                  "it." % version)
    else:
        action = ("The function changed. Diff %s.%s between the newest recorded release and %s, then one of: the "
                  "bug is still there and the seam still fits -> add the printed fingerprint under '%s' and prove "
                  "it (a pinned set, the failing test unpatched and DP-exact patched); the bug is fixed -> "
                  "fixed_in='>=%s'; the code has nothing to patch -> declared={...: reason}; the bug is there but "
                  "the seam no longer fits -> unsupported={...: reason} (a requested patch is then refused loudly)."
                  % (target.module, target.attr, version, version, version))
    return head + " " + action
