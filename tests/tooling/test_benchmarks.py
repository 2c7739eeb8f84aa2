"""Every script in ``benchmarks/`` runs, as a smoke run, on the stacks it measures: none can rot unnoticed.

Each runs as a user runs it (``python benchmarks/X.py``), with its smallest
counts (``--runs 1``, ``--calls 100``); no timing is asserted (these machines
are shared and noisy), only that it finishes and prints what it measures.
Which sets run each one is its ``depends_on`` marker: what the script reads
(torch's FSDP2 internals; transformers' model classes; verl's fused forward).
``benchmarks/startup.py`` runs in ``tests/activation/test_processes.py``,
on the wheel built there.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from fsdp2_compat.core import guards

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
# Each test narrows it with a depends_on marker.
DEPENDS_ON = ("torch", "transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(REPO, "benchmarks")
# Every benchmark and the test that runs it (a new script without a row fails test_every_benchmark_is_run).
RUN_BY = {
    "accumulation_cost.py": "test_accumulation_cost_benchmark_runs",
    "alias_scan.py": "test_alias_scan_benchmark_runs",
    "guard_cost.py": "test_guard_cost_benchmark_runs",
    "import_cost.py": "test_import_cost_benchmark_runs_and_imports_nothing_heavy",
    "lm_head_gather.py": "test_lm_head_gather_benchmark_runs",
    "lm_head_release.py": "test_lm_head_release_benchmark_runs",
    "mixed_ranks.py": "test_mixed_ranks_benchmark_runs",
    "moe_experts.py": "test_moe_experts_benchmark_runs",
    "moved_params.py": "test_moved_params_benchmark_covers_every_selection_family",
    "seam_calls.py": "test_seam_calls_benchmark_runs",
    "text_only_cost.py": "test_text_only_cost_benchmark_runs",
    "gpu_check.py": "test_gpu_check_runs_its_cases_on_the_cpu",
    "startup.py": "tests/activation/test_processes.py::test_startup_benchmark_runs_and_imports_nothing_heavy",
}


def _run(script, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A benchmark's rank processes start their own interpreters: they find this checkout as the test run does.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, "benchmarks/%s %s exited %d:\n%s\n%s" % (
        script, " ".join(args), proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def _needs(*modules):
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip("needs %s (not in this venv)" % ", ".join(missing))


# What a time benchmark prints for each variant against the first (``benchmarks/_cost.py``'s ``print_rows``).
RATIO = "time ratio "
OPS = "aten ops "


@pytest.mark.depends_on()
def test_every_benchmark_is_run():
    names = os.listdir(BENCHMARKS)
    scripts = sorted(n for n in names if n.endswith(".py") and not n.startswith("_"))
    assert scripts == sorted(RUN_BY), "a benchmark without a smoke run here (add it to RUN_BY and a test): %s" % (
        sorted(set(scripts) ^ set(RUN_BY)))
    # A module named _X.py is a helper the scripts share, run through every script that imports it.
    sources = [open(os.path.join(BENCHMARKS, n), encoding="utf-8").read() for n in scripts]
    for helper in (n[:-3] for n in names if n.endswith(".py") and n.startswith("_")):
        assert any(re.search(r"^\s*(import|from) %s\b" % helper, src, re.M) for src in sources), (
            "benchmarks/%s.py is imported by no benchmark" % helper)
    here = open(__file__, encoding="utf-8").read()
    for test in RUN_BY.values():
        path, _, name = test.rpartition("::")
        source = here if not path else open(os.path.join(REPO, path), encoding="utf-8").read()
        assert "def %s(" % name in source, test


@pytest.mark.depends_on("python")
def test_import_cost_benchmark_runs_and_imports_nothing_heavy():
    out = _run("import_cost.py", "--runs", "1")
    assert "heavy modules imported: []" in out


@pytest.mark.depends_on("torch")
def test_alias_scan_benchmark_runs():
    _needs("torch", "transformers")
    out = _run("alias_scan.py", "--runs", "1")
    assert "apply() + revert() of every patch" in out


@pytest.mark.depends_on("torch")
def test_seam_calls_benchmark_runs():
    _needs("torch")
    out = json.loads(_run("seam_calls.py", "--calls", "100", "--json"))
    if guards.in_range(guards.installed_version("torch"), ">=2.15.0"):
        assert "2.15.0 rewrote accumulation" in out["skipped"], out
    else:
        assert set(out) == {"torch", "instance-only", "seam"}, out


@pytest.mark.depends_on("torch")
def test_mixed_ranks_benchmark_runs():
    _needs("torch", "transformers")
    out = _run("mixed_ranks.py")
    assert "without the dummy the ranks hang" in out


@pytest.mark.depends_on("torch")
def test_guard_cost_benchmark_runs():
    _needs("torch", "transformers")
    out = _run("guard_cost.py", *QUICK_VLM, "--steps", "1")
    assert RATIO + "guard on / guard off" in out and OPS in out, out
    assert int(re.search(r"(\d+) checks per step", out).group(1)) > 0, out


@pytest.mark.depends_on("torch")
def test_moe_experts_benchmark_runs():
    _needs("torch", "transformers")
    out = _run("moe_experts.py", "--smoke")
    if "3-D parameters" in out:  # transformers 5.x: nothing to time
        return
    assert RATIO + "patched, ranks reach different experts" in out and OPS in out, out
    assert "the ranks' expert sets differ: True" in out and "= 1.000" in out, out


@pytest.mark.depends_on("transformers")
def test_moved_params_benchmark_covers_every_selection_family():
    """Each family a selection patch covers is measured at real size, or named as skipped with its reason."""
    _needs("torch", "transformers")
    from fsdp2_compat import registry

    sys.path.insert(0, os.path.join(REPO, "tests"))
    from support.real_size import MISSING

    out = json.loads(_run("moved_params.py", "--json", "--quick"))
    step = out["step"]
    assert step.get("skipped") or (step["time_ratio"] > 0 and step["units"]["upstream's selection"] >
                                   step["units"]["corrected selection"]), step
    measured = {row["family"] for row in out["rows"]}
    for family in registry.selection_model_types():
        assert family in measured or family in out["skipped"], family
    for family, reason in out["skipped"].items():
        # Only two reasons: this transformers lacks the family, or real_size says why it has no numbers.
        assert family in MISSING or "transformers" in reason, (family, reason)
    assert all(row["total_params"] > 10**8 for row in out["rows"]), "a real-size model came out tiny"


def _verl_fused_09():
    _needs("torch", "transformers", "verl")
    version = guards.installed_version("verl")
    if not guards.in_range(version, ">=0.9"):
        pytest.skip("written for verl 0.9's fused forward (plain full_tensor()); verl %s here" % version)


@pytest.mark.depends_on("torch", "transformers", "verl")
def test_lm_head_gather_benchmark_runs():
    _verl_fused_09()
    out = _run("lm_head_gather.py", "--vocab", "4096", "--tokens", "16", "--runs", "1")
    assert "unaveraged gradient" in out
    assert out.count(RATIO + "patched: gather_param") == 2 and OPS in out, out  # 1 and 2 ranks


@pytest.mark.depends_on("torch", "transformers", "verl")
def test_lm_head_release_benchmark_runs():
    _verl_fused_09()
    out = _run("lm_head_release.py")
    assert "micro-batch 0" in out


# The smallest real-size VLM the time benchmarks build: 2 vision blocks, no text layer, a 512-token vocabulary.
QUICK_VLM = ("--depth", "2", "--layers", "0", "--vocab", "512", "--tokens", "16", "--image", "56")


@pytest.mark.depends_on("torch", "transformers")
def test_accumulation_cost_benchmark_runs():
    _needs("transformers")
    out = _run("accumulation_cost.py", *QUICK_VLM, "--runs", "1")
    if guards.in_range(guards.installed_version("torch"), ">=2.15.0"):
        assert "installs nothing here" in out, out
    else:
        assert RATIO + "with the fix" in out and OPS in out, out


@pytest.mark.depends_on("torch", "transformers")
def test_text_only_cost_benchmark_runs():
    _needs("transformers")
    out = _run("text_only_cost.py", "--depth", "2", "--layers", "0", "--vocab", "512", "--tokens", "32", "--image",
               "56", "--runs", "1")
    assert "walk / dummy" in out and "walk / floor" in out and "aten ops added" in out, out
    assert "\nfloor " in out, out


@pytest.mark.depends_on("torch", "verl")
def test_gpu_check_runs_its_cases_on_the_cpu():
    """The GPU script (run on a lent device machine) as a CPU smoke run: each case's unpatched failure and
    patched run through verl, and the cost rows at a small geometry (Liger's Triton kernel skipped)."""
    _needs("transformers", "verl")
    out = _run("gpu_check.py", "--device", "cpu", "--quick", timeout=600)
    assert "selection | unpatched: RuntimeError: aten.grid_sampler_2d.default got mixed torch.Tensor and DTensor" \
        in out and "patched (glm4v): trains" in out, out
    assert "cost      | walk" in out and "cost      | floor" in out, out
    assert "offload_rotary | unpatched: trains" in out, out  # CPU buffers on a CPU run: what only a GPU can show
