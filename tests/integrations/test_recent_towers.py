"""transformers 5.24.0's new raw reads (HY-V4-VL vision, MOSS-Transcribe-Diarize audio) on real FSDP2.

docs/audit-sweep.md found, by reading the families new since 5.16.1, two towers whose forward reads an
``nn.Embedding``'s ``.weight`` outside that embedding's forward: ``HYV4VLVisionPatchEmbed`` slices
``position_embedding.weight`` (as HunYuan-VL), ``MossTranscribeDiarizeAudioModel`` adds ``embed_positions.weight``
(as Qwen2-Audio). No framework release admits transformers 5.24.0, so they are shown on the tower itself, with
the frameworks' selection rule and the corrected one (``support.tower_jobs``): 2 gloo ranks, different data.
Unpatched rule: the exact mixed Tensor/DTensor error; corrected rule: every gradient equals the unsharded
DP-average reference (fp32, 1e-5).
"""

import pytest

pytest.importorskip("torch", reason="needs torch (real FSDP2 on CPU gloo)")
pytest.importorskip("transformers", reason="needs transformers (the towers)")

from fsdp2_compat.core import guards  # noqa: E402
from fsdp2_compat_harness.ranks import run_ranks  # noqa: E402
from support import tower_jobs  # noqa: E402

DEPENDS_ON = ("transformers", "torch")

TRANSFORMERS = guards.installed_version("transformers")
MIXED = "RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to " \
        "DTensor before calling distributed operators!"
READ = {"hy_v4_vl": "embeddings.position_embedding", "moss_transcribe_diarize": "embed_positions"}


def _params():
    import importlib.util

    out = []
    for name in tower_jobs.TOWERS:
        present = importlib.util.find_spec("transformers.models.%s" % name) is not None
        marks = [] if present else [pytest.mark.skip(reason="transformers %s has no %s" % (TRANSFORMERS, name))]
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params())
def test_embedding_as_its_own_unit_crashes_at_the_raw_read(name):
    for r in run_ranks(tower_jobs.tower_step, 2, name, "embeddings"):
        assert READ[name] in r["wrapped"], r["wrapped"]
        assert r["error"] == MIXED, r["error"]


@pytest.mark.parametrize("name", _params())
def test_corrected_selection_trains_to_the_dp_average(name):
    results = run_ranks(tower_jobs.tower_step, 2, name, "fixed")
    assert results[0]["loss"] != results[1]["loss"], "same data on both ranks"
    for rank, r in enumerate(results):
        assert r["error"] is None and READ[name] not in r["wrapped"] and r["wrapped"], (rank, r)
        assert r["grads_checked"] > 5 and r["grad_err"] < 1e-5, (rank, r["worst_grad"], r["grad_err"])
