"""A text-only micro-batch's dummy media path at the collectives' floor: record it once, then walk its units.

Why (issue #40): ``fixes.mixed_media`` keeps a text-only rank in the vision
units' FSDP2 collectives by running the model's own media path on a minimal
dummy.  On a GPU that path costs latency, not FLOPs: per-block Python, kernel
launches and host syncs in the rotary and window-index code make a 4-patch
dummy through Qwen2.5-VL-7B's 32-block tower cost 0.6 of a real image step.
What a text-only rank must do is only what the units do: all-gather each unit
in forward (and again in backward), reduce-scatter the gradients it holds, in
the same order as an image rank, and contribute an exact zero.

How:

1. **Record** (the first text-only micro-batch of a model, per dummy kind):
   the real dummy runs as before, observed.  Each FSDP2 unit it calls is
   noted in call order and nesting, with whether its inputs required a
   gradient (FSDP2 then reduces inline, else at the end of backward), whether
   a gradient reached its outputs, and whether backward recomputed it (an
   activation checkpoint: reentrant when its forward ran without grad).  Each
   parameter that received a gradient is noted with the unit that holds it,
   or as "outer" (held by a unit around the tower, already unsharded).  The
   record is complete at the end of the backward that reaches the dummy.
2. **Walk** (every later text-only micro-batch): each recorded unit is called
   through its own ``nn.Module.__call__`` (so FSDP2's own hooks issue the
   all-gather, the reshard, the pre-backward unshard and the reduce-scatter,
   exactly as they do for any forward) with its ``forward`` replaced for that
   one call by a copy of its 0-dim input through an autograd function whose
   backward gives each recorded parameter an exactly-zero gradient (its
   forward reads no parameter): the same units, in the same order and
   nesting, with inputs and outputs that require a gradient where the real
   ones did, checkpointed (reentrant) or without grad where the real call
   was.  No tower code runs.

So the walk issues the collectives of the recorded dummy, which
``mixed_media`` makes those of an image micro-batch; every rank decides alone
and alike (the record depends only on the model and the dummy, never on the
data), and a rank that walks while another records or runs an image still
agrees with it.  The tests compare the collective sequences (unit, kind,
parameters) of an image micro-batch, the dummy and the walk, with gradient
checkpointing off, reentrant and non-reentrant, and prove 2 ranks DP-exact
with mixed text-only / image micro-batches.

Fails safe: anything the record cannot mirror (a unit the media path calls
twice, as Step-3.7's and DeepSeek-OCR-2's view-and-crop dummies do; a module
called inside a unit that the unit does not hold; a unit recomputed only
sometimes; nested checkpoints; a parameter outside the units that is gone or
still sharded when the walk starts) marks the record unusable with the reason
(``why_not``), before any collective of the walk, and that model keeps running
the real dummy: slower, never wrong.  A record is made only in training with
grad enabled and used only in the same mode; a record whose backward never
came (a forward without backward) is dropped and made again.

Delete with ``fixes.mixed_media``.
"""

import weakref

# How many walks ran, records completed, and records found unusable, in this process (tests and benchmarks).
STATS = {"walks": 0, "records": 0, "unusable": 0}

_RECORDS = weakref.WeakKeyDictionary()  # model -> {key: _Record}
_MISSING = object()


class _Call:
    """One call of one FSDP2 unit made by the recorded media path."""

    __slots__ = ("unit", "grad_in", "grad_on", "reached", "recomputed", "children", "params")

    def __init__(self, unit, grad_in, grad_on):
        self.unit = weakref.ref(unit)
        self.grad_in = grad_in  # a floating input required a gradient
        self.grad_on = grad_on  # grad mode was on in its forward (off: inside a reentrant checkpoint)
        self.reached = False  # a gradient reached one of its outputs in backward
        self.recomputed = 0  # times backward ran it again (an activation checkpoint)
        self.children = []  # unit calls made inside it, in order
        self.params = []  # (weakref module, name) of the parameters it holds that received a gradient


class _Record:
    """What the media path of one model did, while it is being observed and once it is complete."""

    def __init__(self, model):
        self.calls = []  # top-level unit calls, in order
        self.outer = []  # (weakref module, name): parameters outside every unit call that the media path reached
        self.why_not = None  # set when the walk cannot mirror what was recorded
        self.complete = False
        self._stack = []
        self._window = True  # the media path's forward is running
        self._hooks = []
        self._by_unit = {}  # unit -> [its calls]
        self._seen = {}  # id(parameter) -> (the unit holding it, module, name, parameter)
        self._grads = set()  # ids of parameters that received a gradient
        self._subtrees = {}
        self._model = weakref.ref(model)

    # --- observing the dummy's forward -------------------------------------------------------------------

    def start(self, model):
        import torch
        from torch.distributed.fsdp import FSDPModule

        self._fsdp = FSDPModule
        for module in model.modules():
            if isinstance(module, FSDPModule):
                self._hooks.append(module.register_forward_pre_hook(self._unit_pre, with_kwargs=True))
                self._hooks.append(module.register_forward_hook(self._unit_post))
        self._global = torch.nn.modules.module.register_module_forward_pre_hook(self._any_pre)

    def stop_window(self):
        self._window = False
        self._global.remove()

    def _subtree(self, unit):
        """Modules ``unit`` holds the parameters of: its subtree, less nested units' subtrees."""
        found = self._subtrees.get(unit)
        if found is None:
            found, todo = [], [unit]
            while todo:
                module = todo.pop()
                found.append(module)
                todo.extend(c for c in module.children() if not isinstance(c, self._fsdp))
            found = self._subtrees[unit] = found
        return found

    def _note_params(self, unit, modules):
        for module in modules:
            for name, param in module._parameters.items():
                if param is None or not param.requires_grad or id(param) in self._seen:
                    continue
                self._seen[id(param)] = (unit, module, name, param)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._got_grad))

    def _got_grad(self, param):
        self._grads.add(id(param))

    def _any_pre(self, module, args):
        """A module called inside a unit call must be one that unit holds (else the walk would unshard the
        wrong unit)."""
        if not self._window or not self._stack or isinstance(module, self._fsdp):
            return
        if not any(m is module for m in self._subtree(self._stack[-1].unit())):
            self._refuse("%s calls %s, which it does not hold" % (type(self._stack[-1].unit()).__name__,
                                                                  type(module).__name__))

    def _unit_pre(self, unit, args, kwargs):
        import torch

        if in_backward():
            calls = self._by_unit.get(unit)
            if calls:  # an activation checkpoint runs it again
                for call in calls:
                    call.recomputed += 1
            return None
        if not self._window:
            return None
        grad_in = any(t.requires_grad for t in floating((args, kwargs)))
        call = _Call(unit, grad_in, torch.is_grad_enabled())
        (self._stack[-1].children if self._stack else self.calls).append(call)
        self._by_unit.setdefault(unit, []).append(call)
        self._stack.append(call)
        # FSDP2's pre-forward hook ran first (it is prepended): the parameters are the unsharded ones
        self._note_params(unit, self._subtree(unit))
        return None

    def _unit_post(self, unit, args, output):
        if in_backward():  # recomputed by a reentrant checkpoint: its forward's outputs required no gradient
            calls = self._by_unit.get(unit, ())
        elif self._window and self._stack and self._stack[-1].unit() is unit:
            calls = (self._stack.pop(),)
        else:
            return None

        def reached(grad):
            for call in calls:
                call.reached = True

        for t in floating(output):
            if t.requires_grad:
                self._hooks.append(t.register_hook(reached))
        return None

    def _refuse(self, why):
        if self.why_not is None:
            self.why_not = why

    # --- completing it ------------------------------------------------------------------------------------

    def finish_after_backward(self, zero):
        """Complete the record at the end of the backward that reaches ``zero`` (now, if none can).

        The parameters outside every unit call that the media path reached are read from ``zero``'s graph
        now (its leaves): a raw read (``self.view_separator``) is no module call, and the same backward also
        brings the text path's gradients, which are not the dummy's."""
        import torch

        self._outer_reached(zero)
        if zero is None or not zero.requires_grad:
            self.finish()
            return

        def queue(grad):
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

        self._hooks.append(zero.register_hook(queue))

    def _outer_reached(self, zero):
        model = self._model()
        if zero is None or zero.grad_fn is None or model is None:
            return
        leaves, seen, todo = set(), set(), [zero.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf the gradient reaches
            if variable is not None:
                leaves.add(id(variable))
            todo.extend(fn for fn, _ in node.next_functions)
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and id(param) in leaves and id(param) not in self._seen:
                    self.outer.append((weakref.ref(module), name))

    def finish(self):
        if self.complete:
            return
        self.drop()
        # A unit called twice (Step-3.7's tower: a view, then a crop) reduces what both calls reached: each
        # call of the walk gives every parameter that received a gradient its zero, as each real call does.
        for unit, module, name, param in self._seen.values():
            if id(param) in self._grads:
                for call in self._by_unit[unit]:
                    call.params.append((weakref.ref(module), name))
        self._seen.clear()
        for calls in self._by_unit.values():
            self._check_recompute(calls)
        self._by_unit.clear()
        self.complete = True
        STATS["records"] += 1
        if self.why_not:
            STATS["unusable"] += 1

    def _check_recompute(self, calls):
        if len(calls) > 1:
            # Step-3.7 / DeepSeek-OCR-2 run their tower twice (a view, then a crop, on independent inputs): the
            # unit's two backward passes share each parameter's gradient accumulation, and whether it reduces
            # once or twice depends on how autograd schedules them (measured with gradient checkpointing on
            # in transformers 5.24.0: the dummy reduced twice, the walk once; without it they agreed).  Not
            # walked: those families keep the real dummy.
            self._refuse("the media path calls %s %d times" % (type(calls[0].unit()).__name__, len(calls)))
        for call in calls:
            if call.recomputed not in (0, len(calls)):
                self._refuse("backward recomputed %s only sometimes" % type(call.unit()).__name__)
            elif call.recomputed and not call.grad_on and any(c.recomputed for c in call.children):
                self._refuse("nested activation checkpoints in %s" % type(call.unit()).__name__)

    def drop(self):
        """Remove every hook (a record abandoned, or complete)."""
        if self._window:
            self.stop_window()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def in_backward():
    """True inside an autograd backward pass (a gradient checkpoint's recompute runs there)."""
    import torch

    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def floating(value):
    """Every floating-point tensor in a value (tensors, tuples, lists, dicts and ``ModelOutput``s)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from floating(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from floating(v)


# --- the walk --------------------------------------------------------------------------------------------------

_ZERO_GRADS = {}


def _zero_grads(x, params):
    """``x``, copied, through an autograd function whose backward gives each of ``params`` an exact-zero
    gradient of its own shape and dtype (and ``x`` the gradient it receives).  Its forward reads no parameter:
    one copy of a 0-dim tensor, whatever the parameters' sizes."""
    fn = _ZERO_GRADS.get("fn")
    if fn is None:
        import torch

        class ZeroGrads(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t, *ps):
                ctx.shapes = [(p.shape, p.dtype, p.device) for p in ps]
                return t.clone()

            @staticmethod
            def backward(ctx, grad):
                zeros = [torch.zeros(shape, dtype=dtype, device=device) if needed else None
                         for (shape, dtype, device), needed in zip(ctx.shapes, ctx.needs_input_grad[1:])]
                return (grad, *zeros)

        fn = _ZERO_GRADS["fn"] = ZeroGrads.apply
    return fn(x, *params)


def _resolve(refs):
    params = []
    for module_ref, name in refs:
        module = module_ref()
        param = None if module is None else module._parameters.get(name)
        if param is None:
            return None
        params.append(param)
    return params


def _through_hooks(unit, fake, x):
    """``unit(x)`` through ``nn.Module.__call__`` (FSDP2's hooks) with ``fake`` as its forward for this call.
    Not ``type(unit).__call__``: a checkpointing layer's override would checkpoint ``fake`` itself, and
    recompute the real forward in backward; ``_walk_call`` checkpoints where the recorded call was."""
    import torch

    saved = unit.__dict__.get("forward", _MISSING)
    unit.__dict__["forward"] = fake
    try:
        return torch.nn.Module.__call__(unit, x)
    finally:
        if saved is _MISSING:
            del unit.__dict__["forward"]
        else:
            unit.__dict__["forward"] = saved


def _walk_call(call, x):
    import torch

    unit = call.unit()

    def fake(t):
        params = _resolve(call.params)
        if params is None:
            raise RuntimeError("fsdp2-compat: a recorded parameter of %s is gone" % type(unit).__name__)
        return _zero_grads(_walk_calls(call.children, t, t.device), params)

    def run(t):
        return _through_hooks(unit, fake, t)

    if call.grad_on or not torch.is_grad_enabled():
        return run(x)
    if call.recomputed:  # a reentrant activation checkpoint, as the recorded call had
        from torch.utils.checkpoint import checkpoint

        return checkpoint(run, x, use_reentrant=True)
    with torch.no_grad():  # the media path ran it without grad (a frozen tokenizer, say)
        return run(x)


def _walk_calls(calls, carry, device):
    """Walk ``calls`` in order from ``carry`` (a 0-dim zero); returns the running zero.  A call whose inputs
    required a gradient takes the running zero (as a tower's blocks take the previous block's output), others
    a fresh zero without one, their outputs added after; an output no gradient reached for real is dropped
    (none may reach it here)."""
    import torch

    side = []
    for call in calls:
        if not call.grad_in:
            x = torch.zeros((), device=device)
        elif carry.requires_grad:
            x = carry
        else:  # (the recorded input required a gradient: FSDP2 then reduces in backward, not after it)
            x = torch.zeros((), device=device, requires_grad=True)
        out = _walk_call(call, x)
        if not call.reached:
            out = out.detach()
        if call.grad_in:
            carry = out
        elif call.reached:
            side.append(out)
    for out in side:
        carry = carry + out.to(carry.dtype)
    return carry


# --- the entry point ---------------------------------------------------------------------------------------

def _key(model, run):
    import torch

    return (getattr(run, "__qualname__", repr(run)), model.training, torch.is_grad_enabled())


def why_not(model, run):
    """Why ``model``'s dummy ``run`` is not walked (None when a complete, usable record exists)."""
    record = _RECORDS.get(model, {}).get(_key(model, run))
    if record is None or not record.complete:
        return "not recorded yet"
    return record.why_not


def zero(model, run, device, dummy):
    """The dummy media path's exact-zero contribution for this micro-batch, at the collectives' floor.

    ``run(model, device)`` is the real dummy; ``dummy(output) -> zero`` turns its output into the zero
    ``mixed_media`` adds.  With a complete, usable record for this model, dummy and mode (training or not,
    grad on or off), the units are walked instead (``STATS["walks"]``); else the real dummy runs, observed
    unless an unusable record says why not.
    """
    records = _RECORDS.setdefault(model, {})
    key = _key(model, run)
    record = records.get(key)
    if record is not None and record.complete and not record.why_not:
        walked = _walk(record, device)
        if walked is not None:
            STATS["walks"] += 1
            return walked
    if record is not None and not record.complete:
        record.drop()  # its backward never came
        record = None
    if record is not None:
        return dummy(run(model, device))  # an unusable record: the real dummy
    record = records[key] = _Record(model)
    record.start(model)
    try:
        out = dummy(run(model, device))
    except BaseException:
        record.drop()
        del records[key]
        raise
    record.stop_window()
    record.finish_after_backward(out)
    return out


def _walk(record, device):
    """The walk's zero, or None when it cannot start (a parameter outside the units is gone or still sharded:
    the record is then marked unusable); nothing has been issued then."""
    import torch

    outer = _resolve(record.outer)
    if outer is None or any(_is_dtensor(p) for p in outer):
        record.why_not = "a parameter the media path reads outside its units is gone or sharded at the dummy"
        STATS["unusable"] += 1
        return None
    return _walk_calls(record.calls, _zero_grads(torch.zeros((), device=device), outer), device)


def _is_dtensor(t):
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)
