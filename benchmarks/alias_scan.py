"""Cost of the engine's alias scan, and of ``apply()`` + ``revert()``, in a process with a training stack loaded.

Each applied target that is a module-level function rebinds the names other
modules imported (``fsdp2_compat/core/aliases.py``), by reading the globals of
every loaded module.  In one run, interleaved, many times, this prints the
median milliseconds of: one scan as it is (``BELOW`` packages skipped), one
scan reading every module (what it was), and ``apply()`` + ``revert()`` of
every patch; with the ratio of the first two and how many globals each reads.
Target: one scan well under the full read (it runs per apply and revert, and
the tests' rank processes do hundreds).

    python benchmarks/alias_scan.py [--runs 15]     (in a venv with torch, transformers and a framework)
"""

import argparse
import os
import statistics
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _load_stack():
    """Import torch, transformers and every installed target module (what a training process has loaded)."""
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    from fsdp2_compat import registry

    return registry.import_installed_targets()[0]


def _globals(skip):
    return sum(len(m.__dict__) for n, m in list(sys.modules.items())
               if isinstance(m, types.ModuleType) and n.partition(".")[0] not in skip)


def _median_ms(fn, runs):
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)
    loaded = _load_stack()

    import fsdp2_compat
    from fsdp2_compat.core import aliases

    def probe():  # an object no module holds: the scan reads everything and changes nothing
        pass

    def scan():
        aliases.rebind(probe, probe)

    def full_scan():
        saved = aliases.BELOW
        aliases.BELOW = frozenset()
        try:
            aliases.rebind(probe, probe)
        finally:
            aliases.BELOW = saved

    def apply_revert():
        fsdp2_compat.apply()
        fsdp2_compat.revert()

    now, before, cycle = [], [], []
    for _ in range(3):  # interleaved: the machine's noise hits all three alike
        now.append(_median_ms(scan, args.runs))
        before.append(_median_ms(full_scan, args.runs))
        cycle.append(_median_ms(apply_revert, max(3, args.runs // 5)))
    now, before, cycle = min(now), min(before), min(cycle)
    print("modules loaded: %d (%d target modules imported)" % (len(sys.modules), len(loaded)))
    print("one scan, BELOW skipped: %.1f ms over %d globals" % (now, _globals(aliases.BELOW)))
    print("one scan, every module:  %.1f ms over %d globals" % (before, _globals(frozenset())))
    print("ratio: %.2f of the full read" % (now / before))
    print("apply() + revert() of every patch: %.1f ms" % cycle)


if __name__ == "__main__":
    main()
