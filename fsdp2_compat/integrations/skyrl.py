"""SkyRL: the FSDP2 wrap selection, inline in ``apply_fsdp2`` in every release.

Two distributions ship the same code under different module paths:
- ``skyrl`` 0.1.0-0.4.0: ``skyrl.backends.skyrl_train.distributed.fsdp_utils``
  (0.4.0's file is byte-identical to 0.3.0's; 0.0.1 is a placeholder without it)
- ``skyrl-train`` 0.1.0-0.3.1: ``skyrl_train.distributed.fsdp_utils`` (the same
  code as verl 0.4.0-0.5.0's inline loop: one fingerprint)
``fsdp_strategy`` imports ``apply_fsdp2`` by name; the engine rebinds it.

The fix upstream is SkyRL PR #2088 (issue #2087), not in any release yet.
When it ships, add its releases as ``fixed_in`` (status then says "not
needed"), and delete these targets once no supported release lacks it.
Fails safe (``fsdp2_compat.core.policy``): the code decides, not the version.
Code whose fingerprint is not listed is refused, with a warning naming the
patch, the release and what to do, and left untouched; a release outside
``versions`` whose code is a recorded release's is patched, and ``status``
says it is outside the proven range (``FSDP2_COMPAT_STRICT=proven`` refuses it).
"""

from ..core.records import Covered, Integration, Target
from ..fixes import WRAP_SELECTION as FIX

# cpu_offload=True: the load ends with every non-persistent buffer (the rotaries' inv_freq) on the CPU (issue #42
# item 2; docs/upstream-problems.md; a GPU shows it: benchmarks/gpu_check.py offload_rotary).
OFFLOAD_BUFFERS = Covered("skyrl.backends.skyrl_train.distributed.fsdp_utils", "_sync_non_persistent_buffers",
                          {"0.3.0-0.4.0": "e8e9bbd884f003a3"}, "not covered: with cpu_offload=True the rotary "
                          "inv_freq buffers stay on the CPU, a device mismatch on a GPU (read, and through FakeTensor "
                          "device checks; not run on a GPU); use cpu_offload=False",
                          fixed=False)

SKYRL_INTEGRATION = Integration(
    dist="skyrl",
    package="skyrl",
    wrap_module="skyrl.backends.skyrl_train.distributed.fsdp_utils",
    callers=("skyrl.backends.skyrl_train.distributed.fsdp_strategy",),
    covered=(OFFLOAD_BUFFERS,),
)

SKYRL_TRAIN_INTEGRATION = Integration(
    dist="skyrl-train",
    package="skyrl_train",
    wrap_module="skyrl_train.distributed.fsdp_utils",
    callers=("skyrl_train.distributed.fsdp_strategy",),
)

SKYRL = Target(
    dist="skyrl",
    module=SKYRL_INTEGRATION.wrap_module,
    attr="apply_fsdp2",
    versions=">=0.1.0,<=0.4.0",
    fingerprints={"0.1.0": "260e89f6d23e4b6c", "0.2.0-0.4.0": "9414d8830a5b5ef4"},
    fix=FIX,
    via="inline loop",
    what="FSDP2 wrap selection (inline loop)",
    diff="wrap-selection",
    declared={"<0.1.0": "0.0.1 is a 1 KB placeholder: no skyrl.backends, nothing to patch"},
)

SKYRL_TRAIN = Target(
    dist="skyrl-train",
    module=SKYRL_TRAIN_INTEGRATION.wrap_module,
    attr="apply_fsdp2",
    versions=">=0.1.0,<=0.3.1",
    fingerprints={"0.1.0-0.3.1": "c1723289c3265bd0"},
    fix=FIX,
    via="inline loop",
    what="FSDP2 wrap selection (inline loop)",
    diff="wrap-selection",
)

TARGETS = (SKYRL, SKYRL_TRAIN)
