"""Wrap-plan auditor: find raw parameter reads that a FSDP2 wrap plan breaks.

Under FSDP2 a unit's parameters are unsharded only while that unit's forward
runs (its pre-forward hook to its post-forward hook).  A parameter of unit
``U`` that some other module's forward reads *directly* (``child.weight``,
never ``child(x)``) is still a sharded ``DTensor`` there, and the first op
that meets a plain tensor raises ``got mixed torch.Tensor and DTensor``.

This package finds those reads without FSDP, a process group or an
accelerator: it computes the units a plan would create (``plan_modules``),
runs one ordinary forward on CPU (``audit``), tracks which modules' forwards
are active with forward pre/post hooks, and watches every torch call with a
``TorchFunctionMode``.  A parameter whose owning unit's forward is not active
is treated as a sharded value; its taint follows the ops applied to it alone
(``view``, ``permute``, ``to`` ... as DTensor would), and the op where it
meets a plain tensor with more than one element is where FSDP2 would raise
(``grid_sample`` for GLM4V's position table).  Metadata access (``.shape``,
``.device``, ``.dtype``, ``.size()``, ``.dim()`` ...) is not a read.

    plan_modules(model, plan, layer_classes=None) -> [module name, ...]   plans
    parameter_owners(model, units) / plan_problems(model, units) -> [Finding]  ownership
    audit(model, batch, units, *, plan=None) -> [Hazard, ...]               tracker
    Coverage: the patch that removes a hazard (from the catalogue)         advice
    build_inputs(args) / apply_fused(model)                                inputs
    report / format_report / sweep / format_sweep                          report
    main(argv) / add_arguments(parser) / run(args)  ``fsdp2-compat audit``  cli

Records (``Hazard``, ``Finding``, ``AuditInputError``) live in ``findings``.
Importing this package imports neither torch, transformers nor verl.
"""

from .cli import add_arguments, main, run
from .findings import NO_PATCH, ROOT, AuditInputError, Finding, Hazard
from .ownership import parameter_owners, plan_problems
from .plans import PLANS, SWEEP_PLANS, UPSTREAM_PLANS, describe_plan, layer_classes_of, plan_modules
from .report import format_report, format_sweep, report, sweep
from .tracker import audit

__all__ = [
    "AuditInputError", "Finding", "Hazard", "NO_PATCH", "PLANS", "ROOT", "SWEEP_PLANS", "UPSTREAM_PLANS",
    "add_arguments", "audit", "describe_plan", "format_report", "format_sweep", "layer_classes_of",
    "main", "parameter_owners", "plan_modules", "plan_problems", "report", "run", "sweep",
]
