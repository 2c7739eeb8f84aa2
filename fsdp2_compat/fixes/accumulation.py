"""FSDP2 gradient accumulation over micro-batches that use different parts of the model.

The targets and the release story are in ``fsdp2_compat.integrations.torch_fsdp``;
this module is the code the two seams install.

``guard_seam`` wraps ``FSDPParam.to_accumulated_grad_if_needed``: a parameter
that has no ``_unsharded_param`` returns at once.  That attribute is created
by the parameter's first all-gather (``FSDPParam.init_unsharded_param``, called
only from ``FSDPParamGroup.wait_for_unshard``) and never deleted
(``free_unsharded_param`` frees the storage of the all-gather outputs only), so
its absence means "never all-gathered in this process".  Such a parameter has
no unsharded gradient to upcast (autograd writes ``.grad`` only on the
``_unsharded_param`` that does not exist) and its ``unsharded_accumulated_grad``
is still ``None`` from ``FSDPParam.__init__``: the method's own outcome for it
is its first ``return``.  It is the test torch's synchronising branch of
``post_backward`` makes (``if not hasattr(fsdp_param, "_unsharded_param"):
continue``).  Every other call runs torch's method unchanged.

``uniform_seam`` wraps ``FSDPParamGroup.post_backward``: when the call will
reduce (``reduce_grads``) and some gathered parameter of the group holds an
accumulated gradient from deferred micro-batches, every gathered parameter
that only has a fresh gradient is first moved to the accumulated form by
torch's own ``FSDPParam.to_accumulated_grad_if_needed`` (``reduce_dtype``, the
gradient cleared); with ``reduce_scatter_unused_params`` (torch 2.13+), the
zero torch would reduce for an unused parameter is created in
``reduce_dtype`` too.  ``foreach_reduce`` asserts one dtype over the list and
then copies every gradient into one ``reduce_dtype`` buffer, so the values it
reduce-scatters are exactly those without the seam (an upcast is exact); only
the list becomes uniform.  Then torch's ``post_backward`` runs unchanged.

Both wrappers are ``wrapt.FunctionWrapper`` around torch's functions (which
stay the code that runs); ``fsdp2_compat.core.engine`` installs and reverts
them.
"""


def never_all_gathered(fsdp_param):
    """True for an ``FSDPParam`` that has not been all-gathered since it was created."""
    return not hasattr(fsdp_param, "_unsharded_param")


def guard_seam(module, attr):
    """``{"FSDPParam.to_accumulated_grad_if_needed": wrapper}``: a never-gathered parameter returns at once.

    The parameter is the method's self however torch (or a subclass) calls it
    (``core.calls``); this runs once per parameter per backward, so the
    wrapper is one receiver lookup and one ``hasattr``.
    """
    import wrapt

    from ..core import calls

    signature = calls.signature_of(module, attr)
    receiver = signature.receiver

    def _skip_never_gathered(wrapped, instance, args, kwargs):
        # ``receiver``'s own first answer, inlined: torch's calls (the instance) cost no extra call
        fsdp_param = instance if instance is not None else receiver(instance, args, kwargs)
        if fsdp_param is not None and never_all_gathered(fsdp_param):
            return None
        return wrapped(*args, **kwargs)

    return {attr: wrapt.FunctionWrapper(calls.lookup(module, attr), _skip_never_gathered)}


def make_gradients_uniform(group):
    """Before ``group``'s synchronising post-backward: fresh-only gradients -> the accumulated form.

    A no-op unless the group will reduce and some gathered parameter already
    holds an accumulated gradient.  Returns how many parameters it converted.
    """
    if not group.reduce_grads:
        return 0
    params = [p for p in group.fsdp_params if not never_all_gathered(p)]
    if not any(p.unsharded_accumulated_grad is not None for p in params):
        return 0
    unused_too = getattr(group, "reduce_scatter_unused_params", False)  # torch 2.13+
    converted = 0
    for p in params:
        if p.unsharded_accumulated_grad is not None or p.reduce_dtype is None:
            continue
        param = p.unsharded_param
        if param.grad is not None:
            p.to_accumulated_grad_if_needed()  # torch's own upcast: param_dtype grad -> reduce_dtype
            converted += p.unsharded_accumulated_grad is not None
        elif unused_too and param.requires_grad:
            import torch

            # torch would reduce torch.zeros_like(unsharded_param) (param_dtype); the same zero
            p.unsharded_accumulated_grad = torch.zeros_like(param, dtype=p.reduce_dtype)
            converted += 1
    return converted


def uniform_seam(module, attr):
    """``{"FSDPParamGroup.post_backward": wrapper}``: one gradient dtype per synchronising reduce."""
    from ..core import calls

    return calls.before_each_call(module, attr, "its FSDPParamGroup (self)", make_gradients_uniform)
