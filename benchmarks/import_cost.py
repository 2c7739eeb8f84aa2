"""Import cost of ``fsdp2_compat.auto`` as a ratio against a bare interpreter start.

Both are measured in this one run, interleaved, many times, and the medians
compared (these machines are noisy: only the ratio in one run means much).
Target: under 5 ms added.  Also checks that no heavy module got imported.

    python benchmarks/import_cost.py [--runs 40]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "transformers", "verl", "skyrl", "skyrl_train", "wrapt", "packaging")


def _time(code, env):
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.pop("FSDP2_COMPAT_PATCHES", None)
    # An installed wheel has its bytecode compiled at install time; measure that
    # (this machine sets PYTHONDONTWRITEBYTECODE, which would time the compiler).
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "fsdp2_compat")], check=True,
                   stdout=subprocess.DEVNULL)
    bare, auto = [], []
    for _ in range(args.runs):
        bare.append(_time("pass", env))
        auto.append(_time("import fsdp2_compat.auto", env))
    check = subprocess.run(
        [sys.executable, "-c", "import sys, fsdp2_compat.auto; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (HEAVY,)],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()
    b, a = statistics.median(bare), statistics.median(auto)
    print("bare interpreter        median %.1f ms" % (b * 1e3))
    print("import fsdp2_compat.auto median %.1f ms" % (a * 1e3))
    print("ratio %.3f, added %.2f ms (target < 5 ms)" % (a / b, (a - b) * 1e3))
    print("heavy modules imported: %s" % check)
    return 0 if check == "[]" else 1


if __name__ == "__main__":
    sys.exit(main())
