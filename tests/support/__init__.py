"""Test-only harness code (never in the wheel), shared by the tests and the benchmarks.

- ``diffs``        parse / check / apply the unified diffs in ``patches/``
- ``releases``     released upstream sources: installed packages and PyPI wheels
- ``oracle``       rank functions of the ``patches/`` oracle (patched source vs runtime patch)
- ``rank_jobs``    other rank functions (wrap plans, verl's GLM4V forward, lm_head traffic)
- ``trl_jobs``     TRL rank functions check does not run (``SFTTrainer.train()``, async distillation)
- ``real_size``    real-size model configs for meta-device counting
- ``skyrl_import`` importing SkyRL's FSDP modules in CPU / Python 3.11 test venvs

``tests/`` is on ``sys.path`` under pytest (the rootdir conftest); benchmarks
add it themselves.
"""
