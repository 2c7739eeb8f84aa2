"""The GPU check (issue #40): the crash-to-fixed cases on CUDA + NCCL and the text-only cost table, one GPU, < 5 min.

Written for the one-GPU device machine a session may be lent (no network:
packages it lacks travel as wheels), and runnable on any CUDA machine with
one GPU; ``--device cpu`` runs the same code on this CPU (gloo) as a smoke run
(``tests/tooling/test_benchmarks.py``), skipping what needs Triton.  Every case
runs in a fresh process (a patch applied in one never leaks into the next),
unpatched then patched, on one rank: two processes cannot share one GPU for
FSDP2 (NCCL refuses duplicate devices), so the per-rank gradient claims stay
with the CPU suite; what one GPU shows is the crash, its absence, and the
patched gradient equal to an unsharded reference.  One line per case:

  liger      accelerate's FSDP2 preparation (``Accelerator.prepare``) of an untied
             tiny Qwen2.5-VL whose forward is Liger-Kernel's own fused linear
             cross entropy (``apply_liger_kernel_to_qwen2_5_vl``: the real Triton
             kernel reads ``lm_head.weight``); patch ``qwen2vl``
  selection  verl's ``apply_fsdp2`` on a tiny GLM-4.1V (the vision
             ``position_embedding`` its own unit: ``grid_sampler_2d`` on a DTensor);
             patch ``glm4v``
  fused      verl's fused-kernel Qwen3-VL forward (``apply_monkey_patch``, torch
             backend) with bf16 parameters / fp32 reduce; patch ``qwen3vl``
  offload_rotary  issue #42 item 2: a tiny Qwen3-VL on the device with every non-persistent buffer
             (``inv_freq``) moved to the CPU, as SkyRL 0.3.0-0.4.0's ``_sync_non_persistent_buffers`` leaves
             them under ``cpu_offload``; one image step: whether the installed transformers' rotaries take
             a CPU ``inv_freq`` (a device mismatch on CUDA, predicted through 5.19.0 for the vision rotary).
             Found, not covered: no patch moves them back, both sides are expected alike.  (The offload
             checks of transformers' native FSDP2 need 2 GPUs: it shards only when dp_replicate_size *
             fsdp_size > 1.)
  cost       ``benchmarks/text_only_cost.py``'s rows at Qwen2.5-VL-7B geometry
             (its 32-block tower, 4 text layers at 3584, its untied 152k
             vocabulary, bf16 parameters / fp32 reduce, 2048-token micro-batches,
             median of 12 steps): text, the real dummy, the walk, the collectives' floor,
             an image

    python benchmarks/gpu_check.py                  # on the GPU (default --device cuda)
    python benchmarks/gpu_check.py --device cpu --quick

On the device machine (see its README): carry this checkout plus the wheels of
what it lacks (fsdp2-compat's own needs: wrapt; liger-kernel; verl ``--no-deps``,
which this script imports without its package ``__init__``), install them with
``pip install --no-deps --target``, put the target on ``PYTHONPATH`` and run
the first line with ``PYTHONPATH`` also holding this checkout.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

CASES = {"liger": "qwen2vl", "selection": "glm4v", "fused": "qwen3vl", "offload_rotary": "qwen3vl"}


def _init(device):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mesh(device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (1,), mesh_dim_names=("fsdp",))


def _grad_err(model, reference):
    from fsdp2_compat_harness.scenarios import full_value, rel_err

    errs = [rel_err(full_value(p.grad).float(), q.grad.float()) for p, q in zip(model.parameters(),
                                                                                 reference.parameters())
            if q.grad is not None and p.grad is not None]
    return max(errs) if errs else None


def _verl_module(name):
    """A verl module; where verl's package ``__init__`` fails (it imports ray and tensordict, which need not
    travel to the device), verl registered without it: its modules are still the released files."""
    import importlib
    import importlib.machinery
    import importlib.util
    import types

    if "verl" not in sys.modules:
        spec = importlib.util.find_spec("verl")
        if spec is None:
            raise ImportError("verl is not installed")
        try:
            importlib.import_module("verl")
        except ImportError:
            for mod in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
                del sys.modules[mod]
            pkg = types.ModuleType("verl", "verl, __init__ skipped (its deps are not installed)")
            pkg.__path__ = list(spec.submodule_search_locations)
            pkg.__spec__ = importlib.machinery.ModuleSpec("verl", None, is_package=True)
            pkg.__spec__.submodule_search_locations = pkg.__path__
            sys.modules["verl"] = pkg
    return importlib.import_module(name)


def case_selection(device):
    import copy

    from fsdp2_compat_harness import tiny

    fsdp_utils = _verl_module("verl.utils.fsdp_utils")
    model = tiny.build("glm4v", tie=False, seed=0).to(device)
    reference = copy.deepcopy(model)
    fsdp_utils.apply_fsdp2(model, {"mesh": _mesh(device)}, {})
    batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in tiny.make_batch("glm4v", reference, seed=1).items()}
    model(**batch).loss.backward()
    reference(**batch).loss.backward()
    return {"grad_err": _grad_err(model, reference)}


def case_fused(device):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp2_compat_harness import tiny
    from fsdp2_compat_harness.scenarios import fused_loss
    from fsdp2_compat_harness.verl_batches import add_verl_position_ids

    fsdp_utils = _verl_module("verl.utils.fsdp_utils")
    monkey_patch = _verl_module("verl.models.transformers.monkey_patch")
    model = tiny.build("qwen3_vl", tie=False, seed=0).to(device)
    monkey_patch.apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                                    fused_kernels_backend="torch")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_utils.apply_fsdp2(model, {"mesh": _mesh(device), "mp_policy": policy}, {})
    batch = tiny.make_batch("qwen3_vl", model, seed=1)
    batch.pop("labels", None)
    add_verl_position_ids(model, batch)
    batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
    loss = fused_loss(model(**batch, return_dict=True), batch)
    loss.backward()
    return {"loss": float(loss)}


def case_liger(device):
    import copy

    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl

    from fsdp2_compat_harness import tiny

    apply_liger_kernel_to_qwen2_5_vl(fused_linear_cross_entropy=True, rope=False)
    model = tiny.build("qwen2_5_vl", tie=False, seed=0).to(device)
    reference = copy.deepcopy(model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True)
    model = Accelerator(fsdp_plugin=plugin).prepare(model)
    batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in
             tiny.make_batch("qwen2_5_vl", reference, seed=1).items()}
    model(**batch).loss.backward()
    reference(**batch).loss.backward()
    torch.cuda.synchronize() if device == "cuda" else None
    return {"grad_err": _grad_err(model, reference)}


def case_offload_rotary(device):
    from fsdp2_compat_harness import native_scenarios, tiny

    model = tiny.build("qwen3_vl", tie=False, seed=0).to(device)
    moved = 0
    for module in model.modules():  # what SkyRL 0.3.0-0.4.0's _sync_non_persistent_buffers leaves (src.cpu())
        for key in list(module._non_persistent_buffers_set):
            if module._buffers.get(key) is not None:
                module._buffers[key] = module._buffers[key].cpu()
                moved += 1
    batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in
             native_scenarios.batch("qwen3_vl", model, 1, "image").items()}
    model(**batch).loss.backward()
    return {"buffers on cpu": moved}


def case_cost(device, quick):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import text_only_cost as cost

    geometry = dict(depth=2, layers=0, vocab=512, tokens=32, image=56, runs=1) if quick else \
        dict(depth=None, layers=4, vocab=152064, tokens=2048, image=448, runs=12)
    dtype = torch.bfloat16 if device == "cuda" else None
    model = cost.build("qwen2_5_vl", geometry["depth"], geometry["layers"], geometry["vocab"], device=device,
                       dtype=None)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None
    cost.shard(model, _mesh(device), policy)
    sync = torch.cuda.synchronize if device == "cuda" else None
    rows = cost.measure(model, "qwen2_5_vl", geometry["runs"], geometry["tokens"], geometry["image"], sync=sync,
                        device=device)
    return {"rows": {k: [v[0], v[1]] for k, v in rows.items()}, "geometry": geometry}


def _child(case, patched, device, quick):
    """One case in this process: ``{"ok": bool, "error" | result...}`` as JSON on the last line."""
    if patched:
        import fsdp2_compat

        fsdp2_compat.apply([CASES[case]])
    _init(device)
    try:
        result = case_cost(device, quick) if case == "cost" else globals()["case_" + case](device)
        result["ok"] = True
    except ImportError as exc:
        result = {"ok": None, "error": "not here: %s" % exc}
    except Exception as exc:  # the unpatched crash, reported
        from fsdp2_compat_harness.scenarios import first_line

        result = {"ok": False, "error": "%s: %s" % (type(exc).__name__, first_line(exc)[:300])}
    print(json.dumps(result))


def _run(case, patched, device, quick, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--device", device, "--child", case,
           "--patched", str(int(patched))] + (["--quick"] if quick else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "timed out after %d s" % timeout}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"ok": False, "error": "exit %d: %s" % (proc.returncode, proc.stderr.strip().splitlines()[-1:])}
    out = json.loads(lines[-1])
    out["s"] = time.monotonic() - start
    return out


def _describe(result):
    if result["ok"] is None:
        return result["error"]
    if not result["ok"]:
        return result["error"]
    if result.get("grad_err") is not None:
        return "trains; gradients vs unsharded reference: %.1e" % result["grad_err"]
    return "trains"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="the cost table at a small geometry (smoke run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--patched", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.patched, args.device, args.quick)
        return 0
    import torch
    import transformers

    print("stack: torch %s, transformers %s, device %s%s" % (
        torch.__version__, transformers.__version__, args.device,
        " (%s)" % torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else ""))
    for case in CASES:
        if case == "liger" and args.device != "cuda":
            print("%-9s | skipped: Liger-Kernel's fused linear cross entropy is a Triton kernel (CUDA)" % case)
            continue
        unpatched, patched = (_run(case, p, args.device, args.quick, timeout=240) for p in (False, True))
        print("%-9s | unpatched: %s | patched (%s): %s" % (case, _describe(unpatched), CASES[case],
                                                           _describe(patched)))
    result = _run("cost", False, args.device, args.quick, timeout=300)  # (the rows install the fix themselves)
    if not result["ok"]:
        print("cost      | %s" % result.get("error"))
        return 1
    rows, text = result["rows"], result["rows"]["text"][0]
    print("cost      | %s" % json.dumps(result["geometry"]))
    for row, (seconds, ops) in rows.items():  # (text_only_cost.ROWS, in order)
        print("cost      | %-5s %8.1f ms  %+8.1f ms (%+.2f of text)  %7d aten ops" % (
            row, 1e3 * seconds, 1e3 * (seconds - text), (seconds - text) / text, ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
