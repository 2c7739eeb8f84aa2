"""One FSDP2 unit per storage dtype: transformers' fp32-kept modules inside a bf16 layer get a unit of their own.

transformers >= 5.24.0 keeps MoE routers in fp32 (``_keep_in_fp32_modules_strict``: ``gate.weight`` of glm4_moe,
glm4v_moe, deepseek_v2, deepseek_v3): loaded with ``dtype=torch.bfloat16``, every bf16 decoder layer holds a
trainable fp32 ``mlp.gate.weight``, one ``fully_shard`` group gets both, and torch's lazy init
(``FSDPParamGroup._init_mp_dtypes``, first forward) raises ``AssertionError: FSDP expects uniform original parameter
dtype but got {torch.bfloat16, torch.float32}``.

``seam`` wraps torch's ``fully_shard`` (the module global of ``torch.distributed.fsdp._fully_shard._fully_shard``;
the engine rebinds every alias by identity: ``torch.distributed.fsdp.fully_shard``, frameworks' imports by name,
accelerate's import at call time).  A call whose trainable parameters not yet in a unit mix storage dtypes keeps
one dtype (its policy's ``param_dtype``, else the largest) and first shards each outermost submodule made only of
another (an "island": the router) with the call's arguments and ``MixedPrecisionPolicy(param_dtype=None,
reduce_dtype=<the call's>, cast_forward_inputs=False)``: it computes in its storage dtype exactly as unsharded, its
gradient reduced as asked; then the call runs as given, on a uniform group.  Any other call is torch's, untouched.
A parameter with no island (fp32 beside bf16 in one module) cannot be split: the call raises first, naming it.

Cost: one all-gather and one reduce-scatter more per island (a router: experts x hidden).  Upstream: transformers
5.24.0 (the fp32 routers), accelerate PR #3985 (its upcast when mixed precision is on), NeMo AutoModel #1677.
Delete when torch's FSDP2 accepts mixed parameter dtypes in one unit, or no trained model keeps a module in another.
"""

UNIFORM_CHECK = "FSDP expects uniform original parameter dtype"
STATS = {"islands": []}  # "Class.sub (dtype)" of every island sharded (tests read it)


def _pending_trainable(modules, ignored):
    """Trainable parameters of ``modules`` that no unit manages yet (not ``ignored``), each once."""
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    managed = {id(p) for m in modules for sub in m.modules() if sub not in modules and isinstance(sub, FSDPModule)
               for p in sub.parameters()}
    seen, out = set(ignored), []
    for m in modules:
        for name, p in m.named_parameters():
            if p.requires_grad and id(p) not in managed and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def plan(modules, ignored=(), param_dtype=None):
    """``[(name, submodule)]`` islands to shard first, or ``[]`` when the call's group is uniform.  The dtype kept is
    the policy's ``param_dtype`` when some parameter has it, else the largest by size; the others form the islands.

    Raises ``ValueError`` when a minority-dtype parameter has no island."""
    params = _pending_trainable(modules, {id(p) for p in ignored})
    sizes = {}
    for _, p in params:
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return []
    major = param_dtype if param_dtype in sizes else max(sizes, key=sizes.get)
    pending = {id(p) for _, p in params}
    minority = {id(p) for _, p in params if p.dtype != major}
    islands, taken = [], set()
    for m in modules:
        for name, sub in m.named_modules():
            own = [p for p in sub.parameters() if id(p) in pending]
            if sub in modules or not own or taken.intersection(map(id, own)):
                continue
            if minority.issuperset(map(id, own)) and len({p.dtype for p in own}) == 1:
                islands.append(("%s.%s" % (type(m).__name__, name), sub))
                taken.update(map(id, own))
    bare = ["%s (%s)" % (n, str(p.dtype).replace("torch.", "")) for n, p in params if id(p) in minority - taken]
    if bare:
        raise ValueError("%s but got %s: %s sit beside %s parameters in one module, so fsdp2-compat cannot give "
                         "them a unit of their own; cast them (or their module) to one dtype before fully_shard"
                         % (UNIFORM_CHECK, sorted(map(str, sizes)), ", ".join(bare), major))
    return islands


def seam(module, attr):
    """``{"fully_shard": wrapper}``: fp32 islands sharded first (see the module doc)."""
    import inspect

    import wrapt
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    MixedPrecisionPolicy = module.__dict__.get("MixedPrecisionPolicy")  # torch.distributed.fsdp may be mid-import

    from ..core.guards import Drift, NotNeeded

    try:
        source = inspect.getsource(inspect.unwrap(FSDPParamGroup.__dict__["_init_mp_dtypes"]))  # torch's, if wrapped
    except (OSError, TypeError, KeyError) as exc:
        raise Drift("FSDPParamGroup._init_mp_dtypes has no readable source (%s)" % exc) from None
    if MixedPrecisionPolicy is None:
        raise Drift("%s has no MixedPrecisionPolicy" % module.__name__)
    if UNIFORM_CHECK not in source:
        raise NotNeeded("this torch's FSDPParamGroup no longer requires one parameter dtype per unit")

    def fully_shard(wrapped, instance, args, kwargs):
        target = args[0] if args else kwargs.get("module")
        modules = list(target) if isinstance(target, (list, tuple)) else [target]
        policy = kwargs.get("mp_policy") or MixedPrecisionPolicy()
        islands = plan(modules, kwargs.get("ignored_params") or (), policy.param_dtype)
        if islands:
            own = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=policy.reduce_dtype, output_dtype=None,
                                       cast_forward_inputs=False)
            rest = {k: v for k, v in kwargs.items() if k != "module"}
            for name, sub in islands:
                wrapped(sub, **dict(rest, mp_policy=own))
                STATS["islands"].append("%s (%s)" % (name, next(sub.parameters()).dtype))
        return wrapped(*args, **kwargs)

    return {attr: wrapt.FunctionWrapper(module.__dict__[attr], fully_shard)}
