"""What a contributor reads when the live census meets a release published after the catalogue was written.

No registry here: the census's own ``classify`` and ``what_to_do`` on a real catalogue target, with the
"release" sources written in the test (the identical code of a recorded release, changed code, a vanished
module). Each message must name the release and the target, say where the target is defined, and say
which edit classifies the release.
"""

from fsdp2_compat.core import guards
from fsdp2_compat.core.records import Target
from fsdp2_compat.integrations import trl, torch_fsdp
from support import census

DEPENDS_ON = ()  # stdlib and the catalogue only

RECORDED = "def add_fused_lm_head(model):\n    model.forward = lambda *a: a\n"
CHANGED = "def add_fused_lm_head(model):\n    model.forward = lambda *a: None\n"


def _like(target, fingerprints):
    """``target`` with other fingerprints (the code of these tests' toy "releases")."""
    return Target(target.dist, target.module, target.attr, target.versions, fingerprints, target.seam,
                  target.what, declared=target.declared, unsupported=target.unsupported)


def test_the_integration_file_of_a_target_is_found():
    assert census.defined_in(trl.FUSED_LM_HEAD) == "fsdp2_compat/integrations/trl.py"
    assert census.defined_in(torch_fsdp.GRAD_ACCUM_GUARD) == "fsdp2_compat/integrations/torch_fsdp.py"


def test_a_new_release_with_a_recorded_releases_code_says_to_widen_the_label():
    target = _like(trl.FUSED_LM_HEAD, {"1.15.0-1.16.0": guards.fingerprint_source(RECORDED, target_attr())})
    verdict, detail = census.classify(target, "1.17.0", lambda: RECORDED)
    assert verdict == "mislabelled"
    message = census.what_to_do(target, "1.17.0", verdict, detail)
    assert message.startswith("trl 1.17.0 is not classified for target trl:trl.trainer.utils.add_fused_lm_head")
    assert "'1.15.0-1.17.0'" in message and "published after 1.16.0" in message


def test_a_new_release_with_new_code_says_how_to_decide_and_prints_the_fingerprint():
    target = _like(trl.FUSED_LM_HEAD, {"1.16.0": guards.fingerprint_source(RECORDED, target_attr())})
    verdict, detail = census.classify(target, "1.17.0", lambda: CHANGED)
    assert verdict == "unclassified"
    message = census.what_to_do(target, "1.17.0", verdict, detail)
    assert guards.fingerprint_source(CHANGED, target_attr()) in message
    for words in ("trl 1.17.0", "fsdp2_compat/integrations/trl.py", "fixed_in='>=1.17.0'", "declared=",
                  "unsupported=", "prove it"):
        assert words in message, words


def test_a_new_release_without_the_module_says_to_find_it_or_declare_it():
    target = _like(trl.FUSED_LM_HEAD, {"1.16.0": guards.fingerprint_source(RECORDED, target_attr())})
    verdict, detail = census.classify(target, "2.0.0", lambda: None)
    message = census.what_to_do(target, "2.0.0", verdict, detail)
    assert verdict == "unclassified" and "trl 2.0.0" in message and "declared={'>=2.0.0'" in message


def target_attr():
    return trl.FUSED_LM_HEAD.attr
