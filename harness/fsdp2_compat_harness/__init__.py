"""fsdp2-compat's harness: what proves the runtime fixes, a distribution of its own (``fsdp2-compat-harness``).

A training process never loads it: the runtime wheel (``fsdp2_compat``) holds
the patches alone.  ``fsdp2-compat check`` / ``audit`` import it, and say how
to install it where it is absent; the test-suite builds on it.

- ``check``       each covered bug unpatched and patched, on the installed stack
- ``audit/``      raw reads across FSDP2 units, found in one CPU forward
- ``tiny/``       download-free tiny models of every family, and their batches
- ``ranks``       N CPU gloo ranks in forkserver processes (``rank_server``: one preloaded server)
- ``scenarios``   training on real FSDP2 against an unsharded data-parallel reference
- ``trl_scenarios``  TRL's loss paths on accelerate's FSDP2 preparation, the same way
- ``verl_batches``  inputs shaped as verl feeds them
- ``subset``      request an exact subset of the catalogue's targets (proofs that isolate one bug)
- ``conventions`` the ways callers call a method, to prove a method seam under each
- ``engines/``    the frameworks' own training engines on CPU ranks, and the CPU stand-ins they need

Importing it imports neither torch nor transformers; they are imported when a
function runs.
"""

__version__ = "0.1.0"
