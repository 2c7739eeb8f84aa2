"""Unified diffs in pure Python: parse, check and apply the source diffs in ``patches/``.

Failures name the diff, the file and the hunk, and show the first line that
differs; ``exact`` refuses a hunk that only applies at an offset (a diff made
against another release).  ``gnu_patch_check`` asks GNU ``patch`` the same.
"""

import os
import re
import shutil
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATCHES = os.path.join(REPO, "patches")


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
