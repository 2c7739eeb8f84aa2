"""Interpreter start-up cost of the fsdp2-compat ``.pth`` bootstrap.

    python benchmarks/startup.py [--reps 200] [--wheel WHEEL] [--workdir DIR] [--check-timing]

Builds the wheel from this repository (or takes ``--wheel``) and makes two
fresh venvs of this interpreter, identical but for the wheel:

    bare       nothing installed
    installed  the wheel (non-editable: its fsdp2_compat_bootstrap.pth is live)

Both reach this interpreter's site-packages (torch, verl, ...) through a path
line, so an eager import would succeed and be seen.  It then times
``python -c pass`` in three variants, interleaved rep by rep so drift and noise
hit all alike, and prints medians and ratios against ``bare``:

    bare                 python -c pass
    installed, unset     FSDP2_COMPAT_PATCHES unset (the .pth reads os.environ only)
    installed, set       FSDP2_COMPAT_PATCHES=all (imports fsdp2_compat, registers hooks)

Targets: unset adds < 1 ms; set adds < 5 ms (including hook registration).
Timing is printed, and enforced only with ``--check-timing`` (shared machines
are noisy).  Always enforced (exit 1 otherwise): with the variable unset the
installed venv loads exactly the modules the bare one does; with it set, no
torch, transformers, verl, skyrl, wrapt, packaging, importlib.metadata or
logging is imported at start-up, and the hooks are registered.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "transformers", "verl", "skyrl", "skyrl_train", "wrapt", "packaging", "logging")
TARGET_UNSET_MS = 1.0
TARGET_SET_MS = 5.0


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP2_COMPAT_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def build_wheel(out):
    src = os.path.join(out, "src")
    os.makedirs(src)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        if os.path.exists(os.path.join(REPO, name)):
            shutil.copy2(os.path.join(REPO, name), src)
    shutil.copytree(
        os.path.join(REPO, "fsdp2_compat"), os.path.join(src, "fsdp2_compat"), ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", src, "-w", out],
        check=True,
    )
    return os.path.join(out, [n for n in os.listdir(out) if n.endswith(".whl")][0])


def make_venv(path, wheel=None):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    python = os.path.join(path, "bin", "python")
    site = os.path.join(path, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
    host = []
    for key in ("purelib", "platlib"):
        if sysconfig.get_paths()[key] not in host:
            host.append(sysconfig.get_paths()[key])
    with open(os.path.join(site, "zzz_host_packages.pth"), "w") as f:
        f.write("\n".join(host) + "\n")
    if wheel:
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], check=True
        )
    return python


def modules_at_start(python, env, cwd):
    code = (
        "import sys; m = sorted(sys.modules); import json; r = {'modules': m}\n"
        "if 'fsdp2_compat' in sys.modules:\n"
        "    from fsdp2_compat.core import engine, hooks\n"
        "    r['waiting'] = hooks.waiting(); r['requested'] = list(engine.requested())\n"
        "print(json.dumps(r))"
    )
    proc = subprocess.run([python, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout), proc.stderr


def check_imports(bare, installed, cwd):
    """Problems found (an empty list is a pass)."""
    problems = []
    base, _ = modules_at_start(bare, clean_env(), cwd)
    unset, err = modules_at_start(installed, clean_env(), cwd)
    if err:
        problems.append("unset: stderr not empty: %r" % err)
    extra = sorted(set(unset["modules"]) - set(base["modules"]))
    if extra:
        problems.append("unset: modules a bare venv does not load: %s" % ", ".join(extra))
    set_, err = modules_at_start(installed, clean_env(FSDP2_COMPAT_PATCHES="all"), cwd)
    if err:
        problems.append("set: stderr not empty: %r" % err)
    heavy = [m for m in set_["modules"] if m.split(".")[0] in HEAVY or m == "importlib.metadata"]
    if heavy:
        problems.append("set: eager imports at start-up: %s" % ", ".join(heavy))
    if not set_.get("waiting") or not set_.get("requested"):
        problems.append("set: no hooks registered (requested %s)" % set_.get("requested"))
    return problems, len(set_["modules"]) - len(base["modules"])


def time_once(python, env, cwd):
    t = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=env, cwd=cwd, check=True)
    return (time.perf_counter() - t) * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="repetitions per variant (interleaved)")
    parser.add_argument("--wheel", help="a built fsdp2-compat wheel (default: build one from this repository)")
    parser.add_argument("--workdir", help="where to put the venvs (default: a temporary folder, removed)")
    parser.add_argument("--check-timing", action="store_true", help="exit 1 when a timing target is missed")
    args = parser.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="f2c-startup-")
    try:
        wheel = args.wheel or build_wheel(os.path.join(work, "wheel"))
        bare = make_venv(os.path.join(work, "bare"))
        installed = make_venv(os.path.join(work, "installed"), wheel)

        problems, set_modules = check_imports(bare, installed, work)

        variants = [
            ("bare", bare, clean_env()),
            ("installed, unset", installed, clean_env()),
            ("installed, set", installed, clean_env(FSDP2_COMPAT_PATCHES="all")),
        ]
        for _, python, env in variants:  # warm the page cache
            time_once(python, env, work)
        samples = {name: [] for name, _, _ in variants}
        for _ in range(args.reps):
            for name, python, env in variants:
                samples[name].append(time_once(python, env, work))

        med = {name: statistics.median(v) for name, v in samples.items()}
        base = med["bare"]
        print("python -c pass, %d interleaved reps per variant, medians (%s)" % (args.reps, sys.version.split()[0]))
        for name, _, _ in variants:
            print("  %-18s %7.2f ms  %6.3f x bare  %+6.2f ms" % (name, med[name], med[name] / base, med[name] - base))
        added_unset = med["installed, unset"] - base
        added_set = med["installed, set"] - base
        verdicts = [
            ("unset adds < %.0f ms" % TARGET_UNSET_MS, added_unset < TARGET_UNSET_MS),
            ("set adds < %.0f ms (hooks registered, %d extra modules)" % (TARGET_SET_MS, set_modules), added_set < TARGET_SET_MS),
        ]
        for label, ok in verdicts:
            print("  target %-52s %s" % (label, "met" if ok else "MISSED"))
        if problems:
            print("eager imports: FOUND")
            for p in problems:
                print("  " + p)
        else:
            print("eager imports: none (unset: same modules as bare; set: no torch/verl/wrapt/packaging/logging)")
        if problems or (args.check_timing and not all(ok for _, ok in verdicts)):
            return 1
        return 0
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
