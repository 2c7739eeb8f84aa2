"""The core's one rule for what a seam's wrapper receives (``fsdp2_compat.core.calls``), on real wrapt.

A toy class method wrapped in a ``wrapt.FunctionWrapper`` exactly as the
seams wrap upstream's, called every way a user's code calls a method
(the harness's ``conventions``, the same subclasses the integration proofs use): the
seam must find the same self and the same arguments each time.  And the
``missing`` contract: a WARNING naming the target and what was missing, an
error under strict mode.  No torch: runs in the first set with the harness.
"""

import logging
import types

import pytest

wrapt = pytest.importorskip("wrapt")
pytest.importorskip("fsdp2_compat_harness", reason="needs the harness (its calling conventions)")

import fsdp2_compat  # noqa: E402
from fsdp2_compat.core import calls  # noqa: E402
from fsdp2_compat_harness.conventions import CONVENTIONS, adopt  # noqa: E402

DEPENDS_ON = ("wrapt", "fsdp2-compat-harness")


class Engine:
    def prepare(self, model, config=None, *, mode="full"):
        return (self, model, config, mode)


def _seen_by_a_seam(cls):
    """Wrap ``cls.prepare`` as a seam does; return the list of what its wrapper read per call."""
    original = vars(cls)["prepare"]
    signature = calls.Signature(original, "toy.Engine.prepare")
    seen = []

    def wrapper(wrapped, instance, args, kwargs):
        seen.append((instance is None,
                     signature.receiver(instance, args, kwargs),
                     signature.argument("model", instance, args, kwargs),
                     signature.argument("config", instance, args, kwargs),
                     signature.argument("mode", instance, args, kwargs)))
        return wrapped(*args, **kwargs)

    return seen, wrapt.FunctionWrapper(original, wrapper)


@pytest.mark.parametrize("convention", CONVENTIONS + ("instance, keywords",))
def test_a_method_seam_finds_self_and_arguments_however_the_method_is_called(convention):
    seen, wrapper = _seen_by_a_seam(Engine)

    class Upstream(Engine):
        prepare = wrapper

    obj = adopt(Upstream(), Upstream, "prepare", convention.partition(",")[0])
    if convention.endswith("keywords"):
        result = obj.prepare(model="m", config="c", mode="lora")
    else:
        result = obj.prepare("m", "c", mode="lora")
    assert result == (obj, "m", "c", "lora")  # upstream's own method got the call intact
    # wrapt 2.x hands the wrapper no instance for the class attribute itself and for a keyword self
    unbound = convention in ("descriptor", "keywords")
    assert seen == [(unbound, obj, "m", "c", "lora")]


def test_defaults_fill_what_the_call_left_out():
    seen, wrapper = _seen_by_a_seam(Engine)

    class Upstream(Engine):
        prepare = wrapper

    obj = Upstream()
    obj.prepare("m")
    vars(Upstream)["prepare"](obj, "m")
    assert seen == [(False, obj, "m", None, "full"), (True, obj, "m", None, "full")]


def test_a_function_seam_reads_its_parameters_by_name():
    def apply_fsdp2(model, fsdp_kwargs, config=None):
        return model

    signature = calls.Signature(apply_fsdp2)
    assert signature.where.endswith("apply_fsdp2")
    for args, kwargs in ((("m", {}), {}), ((), {"model": "m", "fsdp_kwargs": {}}), (("m",), {"fsdp_kwargs": {}})):
        assert signature.argument("model", None, args, kwargs) == "m"
        assert signature.receiver(None, args, kwargs) == "m"
    assert signature.argument("config", None, ("m", {}), {}) is None
    with pytest.raises(KeyError, match="no parameter 'modle'"):
        signature.argument("modle", None, ("m", {}), {})


def test_a_call_without_the_receiver_finds_none():
    signature = calls.Signature(vars(Engine)["prepare"])
    assert signature.receiver(None, (), {}) is None
    assert signature.argument("model", None, (), {}) is None


def test_missing_warns_once_naming_the_target_and_what_was_missing(caplog, monkeypatch):
    monkeypatch.delenv("FSDP2_COMPAT_STRICT", raising=False)
    calls._warned.discard(("toy.Engine.prepare", "a model"))
    with caplog.at_level(logging.WARNING, logger="fsdp2_compat"):
        calls.missing("toy.Engine.prepare", "a model")
        calls.missing("toy.Engine.prepare", "a model")
    lines = [r.getMessage() for r in caplog.records if r.name == "fsdp2_compat"]
    assert len(lines) == 1, lines
    assert "toy.Engine.prepare" in lines[0] and "without a model" in lines[0]
    assert caplog.records[0].levelno == logging.WARNING


def test_missing_raises_under_strict_mode(monkeypatch):
    monkeypatch.setenv("FSDP2_COMPAT_STRICT", "1")
    with pytest.raises(calls.SeamInputError, match="toy.Engine.prepare was called without a model"):
        calls.missing("toy.Engine.prepare", "a model")
    assert issubclass(calls.SeamInputError, fsdp2_compat.Fsdp2CompatError)


def test_missing_raises_when_the_patch_was_requested_strict(toy, monkeypatch):
    import fsdp2_compat

    monkeypatch.delenv("FSDP2_COMPAT_STRICT", raising=False)
    toy.register(monkeypatch, toy.patch(toy.prepare))
    fsdp2_compat.apply("toy", strict=True)
    toy.import_utils()
    with pytest.raises(calls.SeamInputError):
        calls.missing("f2c_toy.utils.Engine.prepare", "a model")
    fsdp2_compat.revert()
    fsdp2_compat.apply("toy")
    calls.missing("f2c_toy.utils.Engine.prepare", "a model")  # not strict: warns, returns


def test_the_parameters_are_those_of_the_code_that_receives_the_call():
    import functools

    def forward(self, input_ids=None, labels=None):
        return input_ids

    @functools.wraps(forward)
    def fused_forward(self, *args, fused_lm_head=False, **kwargs):  # dressed as forward, as TRL's is
        return forward(self, *args, **kwargs)

    @functools.wraps(fused_forward)
    def passthrough(*args, **kwargs):  # a decorator that only passes everything on
        return fused_forward(*args, **kwargs)

    for function in (fused_forward, passthrough):
        signature = calls.Signature(function)
        assert signature.argument("fused_lm_head", None, ("m",), {"fused_lm_head": True}) is True
        assert signature.argument("fused_lm_head", None, ("m",), {}) is False
        assert signature.receiver(None, (), {"self": "m"}) == "m"
