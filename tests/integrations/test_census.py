"""The release census: every published release of every supported distribution is classified.

For each target of the catalogue and each release of its distribution on the
package registry (read without installing or importing it, see
``support/census.py``), the release must be one of:

- covered: its code matches a recorded fingerprint whose label includes it;
- fixed upstream (``fixed_in``);
- declared, with a reason, in the integration module (``Target.declared``).

Anything else fails the test and names the release, the target and the code
found.  The table is printed (``pytest -s``) and written to
``.venv/census/census.md`` (``$FSDP2_CI_CENSUS_CACHE/census.md`` in CI).

Network: the registry's JSON API and range reads of the wheels (a few MB a
release; ~20 MB for verl + SkyRL from a fresh clone).  It runs once per CI run,
in the bare set (``.ci/test`` sets ``FSDP2_CI_CENSUS=1``); anywhere else set
that variable to run it.
"""

import concurrent.futures
import os
import warnings

import pytest

from fsdp2_compat import registry
from support import census

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ()

pytestmark = pytest.mark.skipif(
    os.environ.get("FSDP2_CI_CENSUS") != "1",
    reason="the release census reads every release from the registry: it runs once, in .ci/test's bare set "
           "(set FSDP2_CI_CENSUS=1 to run it here)",
)

PROBLEMS = ("unclassified", "mislabelled")
# A release first uploaded less than this long before the run is reported as a warning, not a failure: the
# registry changes under a submitted commit (transformers 5.25.0 and accelerate 1.16.0 appeared between two
# runs of the same commit), and a CI run must not fail on the day an upstream release appears.  After the grace
# period it fails, so the catalogue still cannot fall behind for long.
GRACE_DAYS = 14


def _census():
    targets = registry.targets()
    dists = sorted({t.dist for t in targets})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        listed = dict(zip(dists, pool.map(census.releases, dists)))
        jobs = {}
        for t in targets:
            for version, files in listed[t.dist].items():
                read = (lambda d=t.dist, v=version, f=files, m=t.module: census.read_module(d, v, f, m))
                jobs[(t.key, version)] = pool.submit(census.classify, t, version, read)
        rows = []
        for t in targets:
            for version in sorted(listed[t.dist], key=_version_key):
                verdict, detail = jobs[(t.key, version)].result()
                rows.append((t, version, verdict, detail))
    return listed, rows


def _version_key(version):
    from packaging.version import Version

    return Version(version)


def _table(rows):
    lines = ["| target | release | verdict | detail |", "|---|---|---|---|"]
    for t, version, verdict, detail in rows:
        lines.append("| %s | %s | %s | %s |" % (t.key, version, verdict, detail.replace("|", "\\|")))
    return "\n".join(lines)


def test_every_published_release_of_every_target_is_classified():
    listed, rows = _census()
    table = _table(rows)
    print()
    print(table)
    os.makedirs(census.CACHE, exist_ok=True)
    with open(os.path.join(census.CACHE, "census.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    assert all(listed.values()), "a distribution with no releases: %s" % listed
    problems, fresh = [], []
    for t, v, verdict, detail in rows:
        if verdict in PROBLEMS:
            age = census.age_days(listed[t.dist][v])
            (fresh if age < GRACE_DAYS else problems).append(
                "- " + census.what_to_do(t, v, verdict, detail) + " (published %.1f days ago)" % age)
    if fresh:
        warnings.warn("%d release(s) published in the last %d days are not classified yet (a failure once they are "
                      "older):\n%s" % (len(fresh), GRACE_DAYS, "\n".join(fresh)), UserWarning)
    assert not problems, "%d published release(s) the catalogue does not classify (new on the registry?):\n%s" % (
        len(problems), "\n".join(problems))
    # Every target fits the code of at least one published release, but one with no seam of its own: its
    # fingerprints are code upstream fixed (``fixed_in`` decides first), it exists for the "not covered" it
    # declares (torch's RECOMPUTE_CAST).
    from fsdp2_compat.core import guards

    declaring = {t.key for t in registry.targets()
                 if t.fixed_in and all(guards.in_range(str(lo), t.fixed_in) for lo, _ in guards.release_spans(t))}
    covered = {t.key for t, _, verdict, _ in rows if verdict == "covered"}
    assert covered == {t.key for t in registry.targets()} - declaring, sorted(
        {t.key for t in registry.targets()} - declaring - covered)
