"""A text-only micro-batch without the tower's code: record the dummy's units once, then walk their collectives.

Why (issue #40): ``mixed_media`` keeps a text-only rank in the vision units' FSDP2 collectives by running the
model's media path on a minimal dummy; on a GPU a tower call costs latency, not FLOPs (Qwen2.5-VL-7B's tower made
a text-only step 288 ms instead of 76 on an H200).  A text-only rank needs only what the units do: all-gather
each one (in forward, again in backward), reduce-scatter what it holds, in an image rank's order, adding an
exact zero.

1. Record (a model's first text-only micro-batch, per dummy and mode): the real dummy runs, observed: the units
   it calls, in order and nesting; whether each call's inputs required a gradient (FSDP2 then reduces inline,
   else after backward), whether a gradient reached its outputs, whether backward recomputed it (reentrant
   checkpoint: its forward ran without grad); the parameters that received a gradient, per unit, and outside
   every unit (held by a unit around the tower, already unsharded: the leaves of the dummy's graph, and the
   parameters of modules it called outside unit calls, which a reentrant checkpoint keeps out of that graph);
   for a unit called more than once (Step-3.7's and DeepSeek-OCR-2's view, then crop), whether autograd
   accumulated its gradient once or at each call.  Complete at the end of the backward that reaches it.
2. Walk (every later one): each recorded unit is called through its own ``nn.Module.__call__``, so FSDP2's
   hooks do what they do for any forward, with its ``forward`` replaced for that call by a copy of a 0-dim zero
   through an autograd function whose backward gives each recorded parameter an exact-zero gradient (it reads
   no parameter); inputs and outputs require a gradient where the real ones did, a call runs checkpointed
   (reentrant) or without grad where the real one did, a unit that accumulated at each call gets its zero
   written at each call (FSDP2 reduces it as often).  No tower code runs.

Every rank decides alone and alike (the record depends on the model and the dummy, never on the data):
``tests/fixes/test_unit_walk.py`` compares an image rank's, a recording rank's and a walking rank's collectives
on every family with a tower, checkpointing off / reentrant / non-reentrant; the mixed-ranks tests train a
walking rank beside an image rank to the DP average.

Fails safe: what the record cannot mirror (a module called inside a unit that does not hold it; a unit
recomputed only sometimes; nested checkpoints; a unit called n times inside reentrant checkpoints, which FSDP2
itself leaves unreduced, or whose gradient accumulated neither once nor n times, or at each call when a call's
input needed no gradient; an outer parameter gone or sharded when a walk starts) makes the record unusable,
with the reason (``why_not``), before any collective of a walk: that model keeps the real dummy.  A record whose
backward never came is made again.  Delete with ``fixes.mixed_media``.
"""

import weakref

# Walks run, records completed, records found unusable, in this process (tests and benchmarks read them).
STATS = {"walks": 0, "records": 0, "unusable": 0}

_RECORDS = weakref.WeakKeyDictionary()  # model -> {(dummy, training, grad on): _Record}
_MISSING = object()


class _Call:
    """One call of one FSDP2 unit by the recorded dummy."""

    __slots__ = ("unit", "grad_in", "grad_on", "reached", "recomputed", "children", "params", "own")

    def __init__(self, unit, grad_in, grad_on):
        self.unit = weakref.ref(unit)
        self.grad_in = grad_in  # a floating input required a gradient
        self.grad_on = grad_on  # grad mode in its forward (off: inside a reentrant checkpoint, or no_grad code)
        self.reached = False  # a gradient reached one of its outputs
        self.recomputed = 0  # times backward ran it again
        self.children = []  # unit calls inside it
        self.params = []  # (weakref module, name): parameters it holds that received a gradient
        self.own = False  # a unit called more than once whose gradient accumulated at each call: its own zero


class _Record:
    """What one model's dummy did: observed while it runs, then complete (or unusable, ``why_not``)."""

    def __init__(self, model):
        self.calls, self.outer, self.why_not, self.complete = [], [], None, False
        self._model = weakref.ref(model)
        self._stack, self._hooks, self._window = [], [], True
        self._by_unit = {}  # unit -> [its calls]
        self._seen = {}  # id(parameter) -> (unit holding it, module, name, parameter)
        self._grads = {}  # id(parameter) -> how many times autograd accumulated a gradient into it
        self._outside = {}  # id(parameter) -> (module, name) of modules the dummy called outside every unit call
        self._subtrees = {}

    def start(self, model):
        import torch
        from torch.distributed.fsdp import FSDPModule

        self._fsdp = FSDPModule
        for module in model.modules():
            if isinstance(module, FSDPModule):  # (after FSDP2's own hooks: its pre-forward is prepended)
                self._hooks.append(module.register_forward_pre_hook(self._unit_pre, with_kwargs=True))
                self._hooks.append(module.register_forward_hook(self._unit_post))
        self._global = torch.nn.modules.module.register_module_forward_pre_hook(self._any_pre)

    def stop_window(self):
        self._window = False
        self._global.remove()

    def _subtree(self, unit):
        if unit not in self._subtrees:
            self._subtrees[unit] = held_modules(unit)
        return self._subtrees[unit]

    def _any_pre(self, module, args):
        """A module called inside a unit call must be one the unit holds (else a walk unshards the wrong unit);
        one called outside every unit call holds outer parameters (held by a unit around the tower)."""
        if not self._window or isinstance(module, self._fsdp):
            return
        if self._stack:
            unit = self._stack[-1].unit()
            if not any(m is module for m in self._subtree(unit)):
                self._refuse("%s calls %s, which it does not hold" % (type(unit).__name__, type(module).__name__))
            return
        for name, param in module._parameters.items():
            # (inside a reentrant checkpoint the forward graph holds none of them: PaddleOCR-VL's tower, in the
            # root unit, under transformers' reentrant checkpointing; they count if a gradient reaches them)
            if param is not None and param.requires_grad and id(param) not in self._outside:
                self._outside[id(param)] = (module, name)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._accumulated))

    def _unit_pre(self, unit, args, kwargs):
        import torch

        if in_backward():  # an activation checkpoint runs it again
            for call in self._by_unit.get(unit, ()):
                call.recomputed += 1
            return None
        if not self._window:
            return None
        call = _Call(unit, any(t.requires_grad for t in floating((args, kwargs))), torch.is_grad_enabled())
        (self._stack[-1].children if self._stack else self.calls).append(call)
        self._by_unit.setdefault(unit, []).append(call)
        self._stack.append(call)
        for module in self._subtree(unit):  # unsharded now: FSDP2's pre-forward ran first
            for name, param in module._parameters.items():
                if param is not None and param.requires_grad and id(param) not in self._seen:
                    self._seen[id(param)] = (unit, module, name, param)
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._accumulated))
        return None

    def _accumulated(self, param):
        self._grads[id(param)] = self._grads.get(id(param), 0) + 1

    def _unit_post(self, unit, args, output):
        if in_backward():  # a reentrant recompute: the forward's outputs required no gradient
            calls = self._by_unit.get(unit, ())
        elif self._window and self._stack and self._stack[-1].unit() is unit:
            calls = (self._stack.pop(),)
        else:
            return None

        def reached(grad):
            for call in calls:
                call.reached = True

        self._hooks.extend(t.register_hook(reached) for t in floating(output) if t.requires_grad)
        return None

    def _refuse(self, why):
        self.why_not = self.why_not or why

    def finish_after_backward(self, zero):
        """Complete the record at the end of the backward that reaches ``zero`` (now if none can).  The outer
        parameters are the leaves of ``zero``'s graph (a raw read such as ``self.view_separator`` is no module
        call, and that backward also brings the text path's gradients)."""
        import torch

        model = self._model()
        if zero is not None and zero.grad_fn is not None and model is not None:
            leaves, seen, todo = set(), set(), [zero.grad_fn]
            while todo:
                node = todo.pop()
                if node is not None and node not in seen:
                    seen.add(node)
                    if getattr(node, "variable", None) is not None:  # an AccumulateGrad
                        leaves.add(id(node.variable))
                    todo.extend(fn for fn, _ in node.next_functions)
            self.outer = [(weakref.ref(m), name) for m in model.modules() for name, p in m._parameters.items()
                          if p is not None and id(p) in leaves and id(p) not in self._seen]
        if zero is None or not zero.requires_grad:
            return self.finish()
        self._hooks.append(zero.register_hook(
            lambda grad: torch.autograd.Variable._execution_engine.queue_callback(self.finish)))

    def finish(self):
        if self.complete:
            return
        self.drop()
        known = {id(m()._parameters.get(name)) for m, name in self.outer if m() is not None}
        self.outer += [(weakref.ref(m), name) for pid, (m, name) in self._outside.items()
                       if pid in self._grads and pid not in known and pid not in self._seen]
        self._outside.clear()
        for unit, module, name, param in self._seen.values():  # each call of a unit: all it received
            if id(param) in self._grads:
                for call in self._by_unit[unit]:
                    call.params.append((weakref.ref(module), name))
        for unit, calls in self._by_unit.items():
            if len(calls) > 1:
                self._called_again(unit, calls)
            for call in calls:
                if call.recomputed not in (0, len(calls)):
                    self._refuse("backward recomputed %s only sometimes" % type(call.unit()).__name__)
                elif call.recomputed and not call.grad_on and any(c.recomputed for c in call.children):
                    self._refuse("nested activation checkpoints in %s" % type(call.unit()).__name__)
        self._seen.clear()
        self._by_unit.clear()
        self.complete = True
        STATS["records"] += 1
        STATS["unusable"] += bool(self.why_not)

    def _called_again(self, unit, calls):
        """Mirror a unit the media path calls more than once.  FSDP2 reduces it at a call's post-backward when its
        parameters hold a gradient then; the calls share each parameter's accumulation, done once after every
        call's backward unless each call's backward is a nested one, which depends on autograd's schedule
        (Step-3.7 on transformers 5.24.0: once without checkpointing or non-reentrant, at each call with the
        text layers reentrant).  So the walk accumulates as often as the record counted (at each call: needs
        every call's input to require a gradient, so a call's post-backward precedes the previous call's
        backward).  Accumulations, not reduces, are counted: a gradient left by a micro-batch without sync
        changes the reduces alike on every rank."""
        if any(call.recomputed and not call.grad_on for call in calls):
            # FSDP2 leaves such a unit unsharded and unreduced (torch 2.13.0 and 2.15.0; DeepSeek-OCR-2 on
            # transformers 5.10.4 / 5.16.1: 0.031 off with every rank on images; docs/upstream-problems.md):
            # the image ranks are wrong too, nothing exact to mirror
            self._refuse("the media path calls %s %d times inside reentrant activation checkpoints, whose "
                         "gradients FSDP2 does not reduce whole" % (type(unit).__name__, len(calls)))
            _warn_once(type(unit).__name__)
            return
        counts = {self._grads[id(param)] for holder, module, name, param in self._seen.values()
                  if holder is unit and id(param) in self._grads}
        if not counts or counts == {1}:
            return
        if counts == {len(calls)} and all(call.grad_in for call in calls):
            for call in calls:
                call.own = True
        else:
            self._refuse("the media path calls %s %d times and autograd accumulated its gradients %s times" % (
                type(unit).__name__, len(calls), "/".join(map(str, sorted(counts)))))

    def drop(self):
        """Remove every hook (a record abandoned, or complete)."""
        if self._window:
            self.stop_window()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


_WARNED = set()


def _warn_once(unit_class):
    """The user's gradients are wrong on every rank, the walk aside: say so once per unit class."""
    if unit_class not in _WARNED:
        import logging

        _WARNED.add(unit_class)
        logging.getLogger("fsdp2_compat").warning(
            "fsdp2-compat: %s runs more than once per step inside reentrant activation checkpoints, and FSDP2 "
            "leaves such a unit's gradients unreduced (an upstream problem, docs/upstream-problems.md): use "
            "gradient_checkpointing_kwargs={'use_reentrant': False}", unit_class)


def held_modules(unit):
    """The modules whose parameters the FSDP2 unit ``unit`` holds: its subtree less nested units'."""
    from torch.distributed.fsdp import FSDPModule

    found, todo = [], [unit]
    while todo:
        found.append(todo.pop())
        todo.extend(c for c in found[-1].children() if not isinstance(c, FSDPModule))
    return found


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
    elif isinstance(value, (dict, tuple, list)):
        for v in (value.values() if isinstance(value, dict) else value):
            yield from floating(v)


_FUNCTIONS = {}


def _functions():
    """The walk's autograd functions (made on first use: torch is imported then), each a copy of its input.
    "shared": its backward gives each parameter passed an exact-zero gradient of its shape and dtype (through
    autograd's accumulation); "own": its backward writes one into each parameter named by ``refs`` that has
    none (resolved then), so the parameter's other calls do not hold it back."""
    if not _FUNCTIONS:
        import torch

        class ZeroGrads(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t, *ps):
                ctx.shapes = [(p.shape, p.dtype, p.device) for p in ps]
                return t.clone()

            @staticmethod
            def backward(ctx, grad):
                return (grad, *[torch.zeros(s, dtype=d, device=dev) if needed else None
                                for (s, d, dev), needed in zip(ctx.shapes, ctx.needs_input_grad[1:])])

        class OwnZeroGrads(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t, refs):
                ctx.refs = refs
                return t.clone()

            @staticmethod
            def backward(ctx, grad):
                for p in _resolve(ctx.refs, strict=True):  # unsharded again now: its pre-backward ran
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                return grad, None

        _FUNCTIONS.update(shared=ZeroGrads.apply, own=OwnZeroGrads.apply)
    return _FUNCTIONS


def _resolve(refs, strict=False):
    params = [None if m() is None else m()._parameters.get(name) for m, name in refs]
    if strict and any(p is None for p in params):  # (a module deleted from a live model)
        raise RuntimeError("fsdp2-compat: a parameter the walk recorded is gone")
    return None if any(p is None for p in params) else params


def _through_hooks(unit, fake, x):
    """``unit(x)`` through ``nn.Module.__call__`` (FSDP2's hooks) with ``fake`` as its forward for this call; not
    ``type(unit).__call__``, whose checkpointing override would recompute the real forward in backward."""
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
        out = _walk_calls(call.children, t, t.device)
        if call.own:
            return _functions()["own"](out, call.params)
        return _functions()["shared"](out, *_resolve(call.params, strict=True))

    def run(t):
        return _through_hooks(unit, fake, t)

    if call.grad_on or not torch.is_grad_enabled():
        return run(x)
    if call.recomputed:  # a reentrant activation checkpoint, as the recorded call had
        from torch.utils.checkpoint import checkpoint

        return checkpoint(run, x, use_reentrant=True)
    with torch.no_grad():  # the dummy ran it without grad (a frozen tokenizer, say)
        return run(x)


def _walk_calls(calls, carry, device):
    """Walk ``calls`` from ``carry`` (a 0-dim zero); returns the running zero.  A call whose inputs required a
    gradient takes it (as a tower's blocks take the previous block's output), others a fresh zero without one,
    their outputs added after; an output no gradient reached for real is dropped (none may reach it here)."""
    import torch

    side = []
    for call in calls:
        if not call.grad_in:
            # (a reentrant checkpoint's output needs an input with a gradient: its backward recomputes the call)
            x = torch.zeros((), device=device, requires_grad=bool(call.recomputed and not call.grad_on))
        else:  # (FSDP2 then reduces this unit in backward, not after it)
            x = carry if carry.requires_grad else torch.zeros((), device=device, requires_grad=True)
        out = _walk_call(call, x)
        out = out if call.reached else out.detach()
        if call.grad_in:
            carry = out
        elif call.reached:
            side.append(out)
    for out in side:
        carry = carry + out.to(carry.dtype)
    return carry


def _key(model, run):
    import torch

    return getattr(run, "__qualname__", repr(run)), model.training, torch.is_grad_enabled()


def why_not(model, run):
    """Why ``model``'s dummy ``run`` is not walked now (None: a complete, usable record)."""
    record = _RECORDS.get(model, {}).get(_key(model, run))
    return "not recorded yet" if record is None or not record.complete else record.why_not


def zero(model, run, device, dummy):
    """This micro-batch's exact-zero contribution of the dummy media path ``run(model, device)`` (``dummy(output)``
    makes it): a walk where a complete, usable record exists for this model, dummy and mode (training or not,
    grad on or off); else the real dummy, recorded unless an unusable record says why not."""
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
        return dummy(run(model, device))
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
    """The walk's zero, or None (the record marked unusable, nothing issued) when an outer parameter is gone or
    still sharded."""
    import torch

    outer = _resolve(record.outer)
    if outer is None or any(_is_dtensor(p) for p in outer):
        record.why_not = "a parameter the media path reads outside its units is gone or sharded at the dummy"
        STATS["unusable"] += 1
        return None
    return _walk_calls(record.calls, _functions()["shared"](torch.zeros((), device=device), *outer), device)


def _is_dtensor(t):
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)
