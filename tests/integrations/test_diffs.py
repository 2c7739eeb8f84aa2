"""``patches/``: the source diffs, checked as an oracle for the runtime patches.

- The patch-set is complete: every registry target has a diff for every
  pinned release in its version range (``engine.diff_path``), and nothing else.
- Every diff applies exactly (no offset, no fuzz) to its release's source: the
  installed package when its version matches, else the wheel from PyPI
  (``pip download --no-deps``, cached; skipped with the reason when PyPI is
  unreachable).  A diff that does not fit fails naming the diff, file and hunk.
- For the releases installed here, the upstream source *patched with the
  diffs* (first on ``PYTHONPATH``, no runtime patch in that process) behaves
  like the installed release with the runtime patches: the same FSDP2 units
  on every tiny model family (untied, tied, tied under an "untied" config
  flag), and fused forwards that match the unsharded data-parallel reference
  on 2 ranks with different data.  TRL (no wrap selection of its own:
  accelerate wraps): its SFT, GRPO-style, distillation and async
  distillation losses on accelerate's FSDP2 preparation match the same
  reference, patched source and runtime patch alike.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from fsdp2_compat import integrations, registry
from fsdp2_compat.core import engine, guards
from fsdp2_compat.integrations import trl as trl_integration
from support import diffs, releases
from support import oracle as oracle_jobs

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("torch", "transformers", "{framework}")

REPO = diffs.REPO

# The upstream releases the pinned test sets (.ci/sets) install.
PINNED = {"verl": ("0.7.0", "0.8.0", "0.9.1"), "skyrl": ("0.1.0", "0.3.0", "0.4.0"), "skyrl-train": ("0.3.1",),
          "areal": ("1.0.4",), "llamafactory": ("0.9.5",), "lmms-engine": ("0.1.4",),
          # trl 1.9.0 (set tf516): axolotl's KD trainer imports it; trl 0.29.1 (set tf516swift): ms-swift's GRPO /
          # GKD trainers import it; no TRL target covers either (no diff to check)
          "trl": ("0.29.1", "1.9.0", "1.14.2", "1.16.0"),
          # torch: its diffs are checked against the installed files (no download of torch); 2.15.0 (set latest)
          # needs none: both accumulation targets declare it not needed (tests/integrations/test_accumulation_declared.py)
          "torch": ("2.13.0", "2.15.0")}
RELEASES = [(d, v) for d, vs in PINNED.items() for v in vs]
# torch's diffs are checked to apply exactly, but the patched-source oracle below does not
# run a patched torch (that would copy the installed torch);
# tests/integrations/test_grad_accumulation.py proves the runtime patch on real FSDP2 instead.
NOT_RUN = ("torch",)
TOL = 1e-5


def module_files(module):
    """The two files a module can be (``a/b.py`` or the package ``a/b/__init__.py``)."""
    stem = module.replace(".", "/")
    return (stem + ".py", stem + "/__init__.py")


def expected_diffs(dist, version):
    """``{diff path: [targets]}`` the registry implies for one release."""
    out = {}
    for target in registry.targets():
        if target.dist != dist or not target.diff or not guards.in_range(version, target.versions):
            continue
        if target.fixed_in and guards.in_range(version, target.fixed_in):
            continue
        out.setdefault(engine.diff_path(target, version), []).append(target)
    return out


ALL_DIFFS = sorted((d, v, path) for d, v in RELEASES for path in expected_diffs(d, v))


def installed(dist):
    """The installed release of ``dist``, without a local build label (``2.13.0+cpu`` is ``2.13.0``)."""
    version = guards.installed_version(dist)
    return version.split("+", 1)[0] if version else version


# ---------------------------------------------------------------------------
# release sources


@pytest.fixture(scope="session")
def release_source(tmp_path_factory):
    """``get(dist, version)``: a directory holding that release's package source.

    The installed package when its version matches (read only), else the
    wheel from PyPI, downloaded once into a cache that outlives the session
    (``FSDP2_CI_WHEEL_CACHE``, default ``$TMPDIR/fsdp2-compat-wheels``).
    """
    cache = os.environ.get("FSDP2_CI_WHEEL_CACHE") or os.path.join(tempfile.gettempdir(), "fsdp2-compat-wheels")
    roots, failures = {}, {}

    def get(dist, version):
        key = (dist, version)
        if key in failures:
            pytest.skip(failures[key])
        if key not in roots:
            if installed(dist) == version and releases.package_root(dist):
                roots[key] = releases.package_root(dist)
            else:
                try:
                    wheel = releases.download_wheel(dist, version, cache)
                except RuntimeError as exc:
                    failures[key] = "cannot get %s %s from PyPI: %s" % (dist, version, exc)
                    pytest.skip(failures[key])
                roots[key] = releases.extract_wheel(wheel, str(tmp_path_factory.mktemp("%s-%s" % (dist, version))))
        return roots[key]

    return get


# ---------------------------------------------------------------------------
# the patch-set


@pytest.mark.depends_on()
def test_patch_set_is_exactly_what_the_registry_implies():
    expected = {path for _, _, path in ALL_DIFFS}
    on_disk = set()
    for base, _, files in os.walk(os.path.join(REPO, "patches")):
        on_disk |= {os.path.relpath(os.path.join(base, f), REPO) for f in files if f.endswith(".diff")}
    assert not expected - on_disk, "missing diffs: %s" % sorted(expected - on_disk)
    assert not on_disk - expected, "diffs no registry target (in range) asks for: %s" % sorted(on_disk - expected)
    index = open(os.path.join(REPO, "patches", "README.md"), encoding="utf-8").read()
    for dist, version, path in ALL_DIFFS:
        targets = expected_diffs(dist, version)[path]
        # Each diff changes exactly the file of the module its targets patch at runtime.
        [changed] = diffs.diff_files(os.path.join(REPO, path))
        assert changed in module_files(targets[0].module), (path, changed)
        assert os.path.isfile(os.path.join(REPO, "patches", dist, version, "README.md")), (dist, version)
        assert os.path.relpath(path, "patches") in index or path in index, "%s is not in patches/README.md" % path


@pytest.mark.depends_on()
def test_pinned_sets_are_covered():
    """Every framework release a CI set pins has its diffs here."""
    sets = os.path.join(REPO, ".ci", "sets")
    if not os.path.isdir(sets):
        pytest.skip("no .ci/sets in this checkout")
    pins = set()
    for name in os.listdir(sets):
        with open(os.path.join(sets, name), encoding="utf-8") as f:
            for line in f:
                m = re.match(r"^\s*(%s)==([\w.]+)(\+\w+)?\s*(#.*)?$" % "|".join(map(re.escape, PINNED)), line)
                if m:
                    pins.add((m.group(1), m.group(2)))
    assert pins <= set(RELEASES), "pinned in .ci/sets but not in PINNED: %s" % sorted(pins - set(RELEASES))


@pytest.mark.depends_on()
def test_diffs_do_not_depend_on_fsdp2_compat():
    for _, _, path in ALL_DIFFS:
        text = open(os.path.join(REPO, path), encoding="utf-8").read()
        added = [l for l in text.splitlines() if l.startswith("+") and not l.startswith("+++")]
        assert not any("fsdp2_compat" in l for l in added), path


@pytest.mark.parametrize("dist,version,path", [
    # A framework's release comes from its wheel wherever the tests run; torch's diffs are checked
    # against the installed torch (its wheel is not downloaded).
    pytest.param(*d, id=d[2][len("patches/"):],
                 marks=pytest.mark.depends_on("torch") if d[0] == "torch" else pytest.mark.depends_on())
    for d in ALL_DIFFS])
def test_diff_applies_exactly_to_its_release(release_source, dist, version, path):
    root = release_source(dist, version)
    label = "%s %s (%s)" % (dist, version, "installed" if installed(dist) == version else "PyPI wheel")
    diffs.check_diff(os.path.join(REPO, path), root, label=label, exact=True)  # raises DiffError naming file and hunk
    gnu = diffs.gnu_patch_check(os.path.join(REPO, path), root)
    if gnu is not None:
        assert gnu[0], "GNU patch -p1 --dry-run -F0 rejects %s on %s:\n%s" % (path, label, gnu[1])


# ---------------------------------------------------------------------------
# the checker's failures


def _other_selection_release(version):
    """A pinned verl release whose wrap-selection diff patches a different seam than ``version``'s."""
    inline = guards.in_range(version, "<0.7.1")
    return next(v for v in PINNED["verl"] if guards.in_range(v, "<0.7.1") != inline)


@pytest.mark.depends_on()
def test_a_diff_that_does_not_fit_names_file_and_hunk(release_source):
    version = installed("verl") if installed("verl") in PINNED["verl"] else "0.9.1"
    root = release_source("verl", version)
    other = _other_selection_release(version)
    diff = os.path.join(REPO, "patches", "verl", other, "wrap-selection.diff")
    with pytest.raises(diffs.DiffError) as info:
        diffs.check_diff(diff, root, label="verl %s" % version)
    message = str(info.value)
    assert "patches/verl/%s/wrap-selection.diff" % other in message
    assert re.search(r"hunk #\d+ \(@@ -\d+,\d+ \+\d+,\d+ @@", message), message
    assert "verl/utils/fsdp_utils.py" in message and "verl %s" % version in message, message
    assert re.search(r"line \d+: expected .*, found ", message), message
    gnu = diffs.gnu_patch_check(diff, root)
    if gnu is not None:
        assert not gnu[0] and "verl/utils/fsdp_utils.py" in gnu[1] and "Hunk #1 FAILED" in gnu[1], gnu[1]


@pytest.mark.depends_on()
def test_a_drifted_line_and_an_offset_are_reported(tmp_path):
    import difflib

    old = ["def f():", "    a = 1", "    return a", "", "", "def g():", "    b = 2", "    return b", ""]
    new = ["def f():", "    a = 10", "    return a", "", "", "def g():", "    b = 20", "    return b", ""]
    (tmp_path / "pkg").mkdir()
    source = tmp_path / "pkg" / "mod.py"
    diff = tmp_path / "x.diff"
    lines = difflib.unified_diff(old, new, "a/pkg/mod.py", "b/pkg/mod.py", n=1, lineterm="")
    diff.write_text("comment line before the diff\n\n" + "\n".join(lines) + "\n")
    source.write_text("\n".join(old))
    assert diffs.check_diff(str(diff), str(tmp_path), exact=True) == {"pkg/mod.py": [(1, 0), (2, 0)]}
    # Upstream moved the code down two lines: applies, but not "exactly".
    source.write_text("\n".join(["# new", "# header"] + old))
    assert diffs.check_diff(str(diff), str(tmp_path)) == {"pkg/mod.py": [(1, 2), (2, 2)]}
    with pytest.raises(diffs.DiffError, match=r"hunk #1 .* its context is found \+2 lines away"):
        diffs.check_diff(str(diff), str(tmp_path), exact=True)
    # Upstream changed a context line of the second hunk.
    source.write_text("\n".join(old).replace("    return b", "    return b + 0"))
    with pytest.raises(diffs.DiffError) as info:
        diffs.check_diff(str(diff), str(tmp_path), label="release X")
    assert "hunk #2 (@@ -6,3 +6,3 @@) of pkg/mod.py does not apply to release X" in str(info.value)
    assert "line 8: expected '    return b', found '    return b + 0'" in str(info.value)
    # A file the diff needs is missing.
    source.unlink()
    with pytest.raises(diffs.DiffError, match=r"pkg/mod.py does not exist in release X"):
        diffs.check_diff(str(diff), str(tmp_path), label="release X")


# ---------------------------------------------------------------------------
# patched source vs runtime patch, for the releases installed here


def _installed_pinned(dist):
    version = installed(dist)
    return version is not None and version in PINNED[dist]


ORACLE_DISTS = [d for d in PINNED if d not in NOT_RUN and _installed_pinned(d)]
WRAPPING = [d for d in PINNED if integrations.get(d).wrap_module is not None]  # TRL leaves wrapping to accelerate
# The TRL oracle needs TRL's diffs: releases its targets cover (1.14.2, set trl114, reads lm_head elsewhere).
TRL_ORACLE = "trl" in ORACLE_DISTS and guards.in_range(installed("trl"), trl_integration.FUSED_LM_HEAD.versions)
# TRL jobs: (family, path); "async" is AsyncDistillationTrainer.compute_loss (tests/support/trl_jobs.py).
TRL_CASES = [("qwen3_vl", "sft"), ("qwen3_vl", "grpo"), ("qwen3_vl", "distill"), ("qwen3_vl", "async"), ("qwen2", "sft")]
VERL_MODULES = ["qwen3_vl", "glm4v", "qwen2_vl", "dense_common", "qwen3_5"]
REAL_FAMILIES = ["qwen3_vl", "qwen2", "glm4v"]  # through verl's own apply_monkey_patch (scenarios.train_fused)


def _families():
    from fsdp2_compat_harness import tiny

    return [f for f in tiny.FAMILIES if tiny.unavailable(f) is None]


def _fused_modules(version):
    return [m for m in VERL_MODULES if "patches/verl/%s/%s-lm-head.diff" % (version, m) in expected_diffs("verl", version)]


def _jobs(tree, patches):
    """The same checks for both sides: ``tree`` (patched source) or ``patches`` (runtime)."""
    families = _families()
    runtime = patches is not None
    jobs = [("wrap:" + d, "wrap_units", 1, [d, families, tree, patches, families if runtime else []])
            for d in ORACLE_DISTS if d in WRAPPING]
    if "verl" in ORACLE_DISTS:
        version = installed("verl")
        modules = _fused_modules(version)
        # Before 0.7.1 lm_head sits in the root unit: upstream does not fail there.
        sensitive = modules if runtime and guards.in_range(version, ">=0.7.1") else []
        args = [modules, [f for f in REAL_FAMILIES if f in families], tree, patches, sensitive]
        jobs.append(("fused", "fused_lm_head", 2, args))
    if TRL_ORACLE:
        # The runtime side runs TRL's own targets: the patches/ diffs are TRL's (the family patches also carry
        # accelerate's tail-unit and transformers' mixed-ranks targets, which have no diffs and change the units).
        trl_targets = [t.key for t in trl_integration.TARGETS] if runtime else None
        jobs += [("trl:%s:%s" % c, "trl_case", 2, [c[0], c[1], tree, trl_targets]) for c in TRL_CASES]
        if runtime:  # upstream without the fix, to show the comparison can tell
            jobs.append(("trl-unpatched:qwen3_vl:sft", "trl_case", 2, ["qwen3_vl", "sft", None, None]))
    return jobs


# The oracle runs every job of this set at once (~30-60 s): its tests share one worker, or each worker
# that gets one of them would run it again.
ORACLE_GROUP = pytest.mark.xdist_group("oracle")


@pytest.fixture(scope="session")
def oracle(tmp_path_factory):
    """``{"source": {job: ...}, "runtime": {job: ...}}`` for every installed pinned release.

    Source side: one fresh interpreter whose ``PYTHONPATH`` starts with a copy
    of the installed packages patched with their release's diffs, and no
    runtime patch.  Runtime side: the installed packages with every runtime
    patch, in this process's rank server.  Both run concurrently.
    """
    tree = str(tmp_path_factory.mktemp("patched-source"))
    for dist in ORACLE_DISTS:
        version = installed(dist)
        releases.copy_installed_package(dist, tree)
        patched_files = set()
        for path in sorted(expected_diffs(dist, version)):
            # Each diff applies exactly to the release (test_diff_applies_exactly_to_its_release); a later diff
            # of a file an earlier one changed (glm4v.py: forward, then lm_head) lands at the offset it made.
            files = set(diffs.diff_files(os.path.join(REPO, path)))
            diffs.apply_diff(os.path.join(REPO, path), tree, label="%s %s (installed copy)" % (dist, version),
                             exact=not files & patched_files)
            patched_files |= files
    from fsdp2_compat_harness import rank_server

    env = dict(os.environ)
    # rank_server.ENV too: the source side's ranks must import the patched tree, not fork from a server
    # that preloaded the installed packages.
    for key in ("FSDP2_COMPAT_PATCHES", "FSDP2_COMPAT_STRICT", rank_server.ENV):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH")) if p)
    code = "from support.oracle import jobs_main; jobs_main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(_jobs(tree, None))],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        runtime = oracle_jobs.run_jobs(_jobs(None, "all"))
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    lines = [l for l in out.splitlines() if l.startswith(oracle_jobs.RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        raise AssertionError("patched-source run failed (%s):\n%s\n%s" % (proc.returncode, out[-3000:], err[-6000:]))
    return {"source": json.loads(lines[-1][len(oracle_jobs.RESULT_MARK):]), "runtime": runtime, "tree": tree}


def _results(oracle, job):
    runtime, source = oracle["runtime"][job], oracle["source"][job]
    if "error" in runtime and "ModuleNotFoundError" in runtime["error"]:
        pytest.skip("the installed release does not import in this venv: %s" % runtime["error"].splitlines()[0])
    assert "error" not in runtime, "runtime side: %s" % runtime["error"]
    assert "error" not in source, "patched-source side: %s" % source["error"]
    return source["result"], runtime["result"]


@pytest.mark.parametrize(
    "framework",
    [pytest.param(d, marks=pytest.mark.skipif(d not in ORACLE_DISTS, reason="%s: no pinned release installed here" % d))
     for d in WRAPPING],
)
@ORACLE_GROUP
def test_patched_source_wraps_the_same_units_as_the_runtime_patch(oracle, framework):
    [source], [runtime] = _results(oracle, "wrap:" + framework)
    families = _families()
    assert source["mode"]["requested"] == [], "runtime patches were active in the patched-source run"
    assert all(f.startswith(oracle["tree"]) for f in source["mode"]["files"].values()), source["mode"]["files"]
    assert runtime["mode"]["requested"], "runtime patches were not requested"
    assert set(source["units"]) == {"%s/%s" % (f, t) for f in families for t in oracle_jobs.tie_variants(f)}
    # One known difference: a config without a top-level tie_word_embeddings (Step-3.7). The diff
    # replaces the loop that reads it; the runtime seam keeps upstream's loop, which raises.
    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.scenarios import tie_flag_refusal

    refused = set()
    for f in families:
        if tie_flag_refusal(framework, tiny.quiet(tiny.tiny_config, f, False)) is not None:
            for t in oracle_jobs.tie_variants(f):
                refused.add("%s/%s" % (f, t))
                assert isinstance(source["units"]["%s/%s" % (f, t)], list), source["units"]["%s/%s" % (f, t)]
                assert "no attribute 'tie_word_embeddings'" in runtime["units"]["%s/%s" % (f, t)]
    mismatches = {k: (v, runtime["units"][k]) for k, v in source["units"].items()
                  if v != runtime["units"][k] and k not in refused}
    assert not mismatches, "patched source vs runtime patch:\n%s" % "\n".join(
        "%s:\n  source  %s\n  runtime %s" % (k, s, r) for k, (s, r) in sorted(mismatches.items())
    )
    for key, units in source["units"].items():
        if key in refused:
            continue
        if isinstance(units, str):  # an upstream limitation both sides share, e.g. no layer classes
            assert units == runtime["unpatched"][key], (key, units)
            continue
        assert "<root>" in units, (key, units)
    assert sum(isinstance(u, list) for u in source["units"].values()) >= len(families), source["units"]
    # The comparison can tell the fix from upstream: GLM-4V's vision position
    # embedding, and tied weights under a flag that says untied.
    if "glm4v" in families:
        assert runtime["unpatched"]["glm4v/untied"] != source["units"]["glm4v/untied"]
    assert any(
        runtime["unpatched"][k] != v for k, v in source["units"].items() if k.endswith("/tied-weights-only")
    ), "tied-by-weights models: upstream and fix agree everywhere"


@pytest.mark.depends_on("torch", "transformers", "verl")
@pytest.mark.skipif("verl" not in ORACLE_DISTS, reason="no pinned verl release installed here")
@ORACLE_GROUP
def test_patched_source_fused_forwards_match_the_runtime_patch(oracle):
    source, runtime = _results(oracle, "fused")
    version = installed("verl")
    lm_head_unit = guards.in_range(version, ">=0.7.1")
    assert all(r["mode"]["requested"] == [] for r in source)
    checked = []
    for key in source[0]["results"]:
        if "skipped" in source[0]["results"][key]:
            assert "skipped" in runtime[0]["results"][key]
            continue
        checked.append(key)
        for rank in range(2):
            s, r = source[rank]["results"][key], runtime[rank]["results"][key]
            for label, res in (("patched source", s), ("runtime patch", r)):
                where = "%s, %s, rank %d" % (key, label, rank)
                assert res["error"] is None, "%s: %s" % (where, res["error"])
                assert ("lm_head" in res["wrapped"]) == lm_head_unit, (where, res["wrapped"])
                assert res["loss_err"] < TOL and res["lm_head_grad_err"] < TOL, (where, res)
                assert res["grad_err"] < TOL, "%s: worst gradient %s %.2e" % (where, res["worst_grad"], res["grad_err"])
                assert res["param_err"] < TOL, (where, res["param_err"])
                if key.startswith("module:"):
                    assert res.get("accum_error") is None and res["accum_grad_err"] < TOL, (where, res)
                    assert res.get("no_grad_error") is None and res["no_grad_resharded"], (where, res)
            assert s["wrapped"] == r["wrapped"], key
            assert s["losses"] == pytest.approx(r["losses"], rel=1e-6, abs=1e-6), key
        assert source[0]["results"][key]["losses"] != source[1]["results"][key]["losses"], "same data on both ranks"
    assert any(k.startswith("module:") for k in checked), "no fused forward was checked"
    if lm_head_unit:
        # Upstream without the fix fails here: the fused read crashes, or (plain
        # full_tensor()) the lm_head gradient misses the data-parallel average.
        for key, res in runtime[0]["unpatched"].items():
            if "skipped" in res:
                continue
            crashed = res["error"] is not None and "got mixed torch.Tensor and DTensor" in res["error"]
            assert crashed or res["lm_head_grad_err"] > 1e-3, (key, res)


@pytest.mark.depends_on("torch", "transformers", "trl", "accelerate")
@pytest.mark.skipif(not TRL_ORACLE, reason="no trl release with TRL diffs installed here (patches/trl/1.16.0 only)")
@ORACLE_GROUP
def test_patched_source_trl_losses_match_the_runtime_patch(oracle):
    for family, path in TRL_CASES:
        source, runtime = _results(oracle, "trl:%s:%s" % (family, path))
        for rank in range(2):
            s, r = source[rank], runtime[rank]
            assert s["mode"]["requested"] == [] and r["mode"]["requested"], (family, path)
            assert all(f.startswith(oracle["tree"]) for f in s["mode"]["files"].values()), s["mode"]["files"]
            for label, res in (("patched source", s["result"]), ("runtime patch", r["result"])):
                where = "%s %s, %s, rank %d" % (family, path, label, rank)
                assert res["error"] is None, "%s: %s" % (where, res["error"])
                assert res["head_weight"] == "DTensor" and "lm_head" in res["wrapped"], (where, res["wrapped"])
                assert res["loss_err"] < TOL and res["param_err"] < TOL, (where, res)
                assert res["lm_head_rel_to_max"] < TOL, (where, res["lm_head_rel_to_max"])
                assert res["grad_err"] < TOL, "%s: worst gradient %s %.2e" % (where, res["worst_grad"], res["grad_err"])
            assert s["result"]["wrapped"] == r["result"]["wrapped"]
            kernels = [[list(k) for k in res["result"].get("kernel_weights", ())] for res in (s, r)]
            assert kernels[0] == kernels[1], (family, path, kernels)  # the source side came back through JSON
            assert s["result"]["losses"] == pytest.approx(r["result"]["losses"], rel=1e-6, abs=1e-6), (family, path)
        assert source[0]["result"]["losses"] != source[1]["result"]["losses"], "same data on both ranks"
    unpatched = oracle["runtime"]["trl-unpatched:qwen3_vl:sft"]
    assert "error" not in unpatched, unpatched
    assert all(r["result"]["lm_head_rel_to_max"] > 0.1 for r in unpatched["result"]), unpatched["result"]
