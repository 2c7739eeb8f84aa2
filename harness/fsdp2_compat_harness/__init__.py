"""The tooling beside the runtime: ``fsdp2-compat check`` and ``audit``, and the harness they run.

- ``check``       each covered bug unpatched and patched, on the installed stack
- ``audit/``      raw reads across FSDP2 units, found in one CPU forward
- ``tiny/``       download-free tiny models of every family, and their batches
- ``ranks``       N CPU gloo ranks in forkserver processes
- ``scenarios``   training on real FSDP2 against an unsharded data-parallel reference
- ``trl_scenarios``  TRL's loss paths on accelerate's FSDP2 preparation, the same way
- ``verl_batches``  inputs shaped as verl feeds them
- ``subset``      request an exact subset of the catalogue's targets (proofs that isolate one bug)
- ``engines/``    the frameworks' own training engines on CPU ranks (verl's FSDP engine, SkyRL's FSDPStrategy)

Nothing here is imported by ``import fsdp2_compat`` or at start-up; torch and
transformers are imported when a function runs.
"""
