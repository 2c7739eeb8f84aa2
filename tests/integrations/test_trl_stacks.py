"""On which stacks TRL's unaveraged ``lm_head`` gradient exists: the cause, checked on the installed stack.

The bug needs two things (``fsdp2_compat/integrations/trl.py``): accelerate >= 1.14 puts the untied head in a
tail unit with the final norm that ``accelerate.utils.fsdp_utils._find_final_norm`` finds among the base
model's *direct* children, and TRL reads ``lm_head.weight`` outside the head's forward. Where the base model
has such a norm (text models), the norm's forward unshards the tail before TRL reads it: exact. Where it has
none (the VLMs: ``visual`` and ``language_model``), the tail is ``[lm_head]`` alone and TRL trains the head on
each rank's own gradient.

So whether a stack has the bug is a property of the installed transformers' module tree and the installed
accelerate, and the tests below derive the expected training outcome from that property, then train
(unpatched, 2 CPU gloo ranks, different data, against the unsharded DP-average reference). A claim that
Qwen3-VL is exact unpatched on transformers 5.24.0 (issue #21, item 4) did not reproduce: on 5.24.0 the base
model's children are the same as on 5.8.0 and the gradient is off the same way (docs/trl-stacks.md).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (tiny models)")
pytest.importorskip("trl", reason="needs trl (the code under test)")
pytest.importorskip("accelerate", reason="needs accelerate (TRL's FSDP2 preparation)")

from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness import tiny  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from fsdp2_compat_harness.trl_scenarios import train_trl  # noqa: E402

DEPENDS_ON = ("transformers", "accelerate", "trl", "torch")

TRL = guards.installed_version("trl")
ACCELERATE = guards.installed_version("accelerate")
TRANSFORMERS = guards.installed_version("transformers")
pytestmark = [
    pytest.mark.skipif(not guards.in_range(TRL, ">=1.16.0"),
                       reason="trl %s: the fused head runs on CPU from 1.16.0 (1.15.0 needs Triton)" % TRL),
    pytest.mark.skipif(not guards.in_range(ACCELERATE, ">=1.14.0"),
                       reason="accelerate %s keeps lm_head in the root unit (the tail unit is 1.14.0+)" % ACCELERATE),
]
FAMILIES = ("qwen3_vl", "qwen2_5_vl", "qwen2")


def _tail_norm(family):
    """What accelerate's ``_find_final_norm`` puts beside the head on this stack (None: the head alone)."""
    from accelerate.utils.fsdp_utils import _find_final_norm

    model = tiny.build(family, tie=False, seed=0)
    base = getattr(model, model.base_model_prefix)
    norm = _find_final_norm(model)
    return norm, sorted(n for n, _ in base.named_children())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tail_unit_holds_a_norm_only_where_the_base_model_has_one_as_a_direct_child(family):
    norm, children = _tail_norm(family)
    print("transformers %s accelerate %s %s: base model children %s, tail norm %s"
          % (TRANSFORMERS, ACCELERATE, family, children, type(norm).__name__ if norm is not None else None))
    if family == "qwen2":
        assert norm is not None and "norm" in children, children
    else:  # the VLMs' base models: a vision tower and a language model, no norm of their own
        assert norm is None and {"visual", "language_model"} <= set(children), children


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2"])
def test_unpatched_sft_head_gradient_is_exact_exactly_where_the_tail_holds_a_norm(family):
    norm, _ = _tail_norm(family)
    results = run_ranks(train_trl, 2, family, "sft", None)
    assert results[0]["losses"] != results[1]["losses"], "same data on both ranks"
    for rank, r in enumerate(results):
        assert r["error"] is None and r["head_weight"] == "DTensor", (rank, r["error"], r["head_weight"])
        print("transformers %s %s unpatched: lm_head max|a-b|/max|b| %.3g" % (
            TRANSFORMERS, family, r["lm_head_rel_to_max"]))
        if norm is None:  # the bug: each rank's own micro-batch gradient (measured 0.99 on 5.8.0 and 5.24.0)
            assert r["lm_head_rel_to_max"] > 0.1, r["lm_head_rel_to_max"]
        else:
            assert r["lm_head_rel_to_max"] < 1e-5 and r["grad_err"] < 1e-5, (r["worst_grad"], r["grad_err"])
