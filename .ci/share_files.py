"""Hard-link the files that pinned sets' venvs have in common (stdlib only).

    python .ci/share_files.py STORE VENV [VENV ...]

Why: nine of the twelve venvs hold the same torch 2.13.0+cpu (and the same
numpy, pandas, pyarrow, ray...), ~1.7 GB each, 26 GB in all: more than this
kind of machine's page cache.  A set then starts with its own cold copy of
libtorch and reads it again at ~12 MB/s of page faults (a cold ``import torch,
transformers`` took 36 s where a warm one takes 4.5 s).  With one inode per
distinct file the page cache holds one copy, and the next set finds it warm.

What is shared, and why it is safe:
- a file some installed distribution's RECORD lists with a sha256 and a size
  (what a wheel install writes verbatim), whose size still matches and that
  was not modified after its RECORD was written: two such files with the same
  hash are the same bytes.  Scripts outside site-packages (bin/), ``.pth``
  files and the repo's own editable install are never shared;
- a byte-code file (``__pycache__/*.pyc``) of a shared source, keyed by the
  source's hash and the pyc's name and magic number, and only while its header
  still validates against the shared source (mtime and size of the one inode),
  so Python never finds it stale.  The code's ``co_filename`` names the venv
  that compiled it; the import system rewrites it to the importing path.
Nothing writes into these files later: pip and Python's byte-code writer
replace files (a new inode), they never write into an existing one.

``STORE`` holds one link per distinct file (``objects/``, named by hash); an
object no venv links any more (link count 1, e.g. after a set was rebuilt) is
removed.  A venv is marked done with ``.fsdp2-shared``; .ci/install-set calls
this once per built venv.
"""

import base64
import fcntl
import os
import struct
import subprocess
import sys

MARK = ".fsdp2-shared"
REV = "1"  # bump when what is shared changes: every venv is then processed again
OWN = ("fsdp2_compat", "fsdp2-compat")


def site_dirs(venv):
    lib = os.path.join(venv, "lib")
    return [os.path.join(lib, d, "site-packages") for d in sorted(os.listdir(lib))
            if os.path.isdir(os.path.join(lib, d, "site-packages"))]


def recorded(site):
    """(absolute path, hex sha256, size, when its RECORD was written) of every hashed file a RECORD lists."""
    for entry in sorted(os.listdir(site)):
        if not entry.endswith(".dist-info") or entry.split("-")[0].lower() in OWN:
            continue
        record = os.path.join(site, entry, "RECORD")
        try:
            written = os.stat(record).st_mtime
            lines = open(record, encoding="utf-8").read().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.rsplit(",", 2)
            if len(parts) != 3 or not parts[1].startswith("sha256=") or not parts[2].isdigit():
                continue
            path = os.path.normpath(os.path.join(site, parts[0]))
            if not path.startswith(site + os.sep) or path.endswith(".pth"):
                continue
            digest = base64.urlsafe_b64decode(parts[1][7:] + "=" * (-len(parts[1][7:]) % 4)).hex()
            yield path, digest, int(parts[2]), written


def link_over(source, path):
    """Make ``path`` another name of ``source``'s inode (atomically: never a missing file)."""
    tmp = path + ".fsdp2-link"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.link(source, tmp)
    os.replace(tmp, path)


def object_path(store, key):
    return os.path.join(store, "objects", key[:2], key[2:])


def valid_pyc(pyc, source_stat):
    """Whether Python would use ``pyc`` for a source with ``source_stat`` (its 16-byte header), and its magic."""
    try:
        with open(pyc, "rb") as f:
            head = f.read(16)
    except OSError:
        return False, None
    if len(head) < 16:
        return False, None
    flags = struct.unpack("<I", head[4:8])[0]
    if flags & 1:  # hash-based: valid whatever the mtime (checked or not, the hash is of the same bytes)
        return True, head[:4].hex()
    mtime, size = struct.unpack("<II", head[8:16])
    ok = mtime == (int(source_stat.st_mtime) & 0xFFFFFFFF) and size == (source_stat.st_size & 0xFFFFFFFF)
    return ok, head[:4].hex()


def share(store, venv):
    counts = dict.fromkeys(("already", "linked", "stored", "kept", "pyc linked", "pyc stored", "pyc compiled",
                            "pyc stale"), 0)
    stale = []
    for site in site_dirs(venv):
        for path, digest, size, written in recorded(site):
            obj = object_path(store, digest)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            try:
                ost = os.stat(obj)
            except FileNotFoundError:
                ost = None
            if ost is not None and ost.st_ino == st.st_ino:
                counts["already"] += 1
            # modified after the install wrote its RECORD, or not what RECORD says: this venv's own
            elif (not os.path.isfile(path) or os.path.islink(path) or st.st_size != size or st.st_mtime > written + 2
                  or (ost is not None and ost.st_size != size)):
                counts["kept"] += 1
                continue
            elif ost is None:
                os.makedirs(os.path.dirname(obj), exist_ok=True)
                os.link(path, obj)
                counts["stored"] += 1
            else:
                link_over(obj, path)
                counts["linked"] += 1
            if path.endswith(".py"):
                share_pycs(store, path, digest, stale, counts)
    if stale:
        recompile(venv, stale, counts)
    return counts


def share_pycs(store, source, digest, stale, counts):
    folder = os.path.join(os.path.dirname(source), "__pycache__")
    stem = os.path.basename(source)[:-3] + "."
    try:
        names = [n for n in os.listdir(folder) if n.startswith(stem) and n.endswith(".pyc")]
    except OSError:
        return
    source_stat = os.stat(source)
    for name in names:
        pyc = os.path.join(folder, name)
        ok, magic = valid_pyc(pyc, source_stat)
        if magic is None:
            continue
        obj = object_path(store, "%s-%s-%s" % (digest, magic, name[len(stem):]))
        if os.path.exists(obj):
            if valid_pyc(obj, source_stat)[0] and os.stat(obj).st_ino != os.stat(pyc).st_ino:
                link_over(obj, pyc)
                counts["pyc linked"] += 1
        elif ok:
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            os.link(pyc, obj)
            counts["pyc stored"] += 1
        else:  # the source is now another venv's inode (its mtime) and no venv of this Python stored a pyc yet
            stale.append((source, pyc, obj))


def recompile(venv, stale, counts):
    """Compile the stale byte-code with the venv's own interpreter, then store it for the next venv."""
    script = ("import py_compile, sys\n"
              "for line in sys.stdin.read().splitlines():\n"
              "    source, pyc = line.split('\\0')\n"
              "    py_compile.compile(source, cfile=pyc, doraise=False, quiet=2,\n"
              "                       invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)\n")
    subprocess.run([os.path.join(venv, "bin", "python"), "-c", script], check=True,
                   input="\n".join("%s\0%s" % (source, pyc) for source, pyc, _ in stale), text=True)
    for source, pyc, obj in stale:
        if valid_pyc(pyc, os.stat(source))[0] and not os.path.exists(obj):
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            os.link(pyc, obj)
            counts["pyc compiled"] += 1
        else:
            counts["pyc stale"] += 1  # Python recompiles it on first import, as it would have anyway


def prune(store):
    """Remove the objects no venv links any more."""
    removed = 0
    root = os.path.join(store, "objects")
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            try:
                if os.stat(path).st_nlink == 1:
                    os.unlink(path)
                    removed += 1
            except OSError:
                pass
    return removed


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__.split("\n\n")[1])
    store, venvs = os.path.abspath(argv[0]), [os.path.abspath(v) for v in argv[1:]]
    os.makedirs(store, exist_ok=True)
    with open(os.path.join(store, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer of the store at a time
        for venv in venvs:
            counts = share(store, venv)
            with open(os.path.join(venv, MARK), "w") as f:
                f.write(REV + "\n")
            print("[share-files] %s: %s" % (os.path.basename(venv), ", ".join("%s %d" % kv for kv in counts.items())))
        print("[share-files] %d objects no venv uses removed" % prune(store))


if __name__ == "__main__":
    main(sys.argv[1:])
