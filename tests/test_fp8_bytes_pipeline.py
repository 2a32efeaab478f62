"""Bytes under a real pipeline: a pp2 step of the trainer (1F1B, 4 micro-batches) quantizes, for each recipe,
exactly the FP8 GEMM operands the single rank quantizes in the same step: data and scales
(``.view(torch.uint8)``) of every operand of stage 0 and of stage 1, together, are the single rank's,
none missing and none extra.

A stage holds whole layers, so no scale is ever reduced over pp, and the activations and gradients the
stages pass are the single rank's exactly (fp32, the same micro-batches, the same loss scale): every
operand, forward and backward, is the same tensor. (packages/par-tp/tests/test_fp8_bytes.py proves the
operands under tp, SP, cp and dp; this is the pipeline in the trainer.)
"""

import hashlib
from collections import Counter

import pytest
import torch

from par_tp.fp8 import RECIPES

BASE = ["model.layers=2", "train.steps=1", "train.warmup_steps=1", "train.eval_every=0", "log.progress=false",
        "train.seq_len=32", "train.global_batch=4", "train.micro_batch=1"]


def _digest(q) -> str:
    h = hashlib.sha256()
    for t in (q.data, q.scale):
        t = t.contiguous().reshape(t.shape or (1,))
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# DeepSeek-V3's latent attention and multi-token prediction (tests/test_layouts_fp8.py's MLA_MTP): MLA's
# down-projections and MTP's eh_proj are FP8 linears of their own, MTP on the last stage
MLA_MTP = ["model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
           "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.mtp_depth=1",
           "model.mtp_loss_weight=0.5"]


def operand_digests(overrides: list[str]) -> dict[str, Counter]:
    """Per recipe, the multiset of (operand, digest of its data and scales) one train step quantizes here."""
    from par_tp.fp8 import recording
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    out = {}
    for recipe in RECIPES:
        trainer = Trainer(load_config("tiny", BASE + overrides + [f"train.fp8={recipe}"]))
        with recording() as taps:
            trainer.train_step(0)
        out[recipe] = Counter((what, _digest(q)) for what, q in taps)
    return out


def _digests(dist_run, model):
    stages = dist_run(2, operand_digests, model + ["parallel.pp=2", "parallel.schedule=1f1b"], timeout=300)
    single = dist_run(1, operand_digests, model, timeout=300)[0]
    return stages, single


@pytest.fixture(scope="module")
def digests(dist_run):
    return _digests(dist_run, [])


@pytest.fixture(scope="module")
def mla_mtp_digests(dist_run):
    return _digests(dist_run, MLA_MTP)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_pp2_stages_quantize_the_single_ranks_operands(digests, recipe):
    _assert_same_operands(digests, recipe)


@pytest.mark.extended
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_pp2_mla_mtp_stages_quantize_the_single_ranks_operands_extended(digests, mla_mtp_digests, recipe):
    """MLA + MTP: the same proof, with MLA's replicated down-projections and MTP's eh_proj among the
    operands (MTP runs on the last stage with its copy of the embedding): 25 FP8 linears (two MLA layers'
    5 + 3, the MTP layer's 8 and eh_proj) against the GQA model's 14, each with as many operands."""
    _assert_same_operands(mla_mtp_digests, recipe)
    mla, gqa = mla_mtp_digests[1][recipe], digests[1][recipe]
    assert sum(mla.values()) * 14 == sum(gqa.values()) * 25, (sum(mla.values()), sum(gqa.values()))


def _assert_same_operands(digests, recipe):
    stages, single = digests
    assert all(stage[recipe] for stage in stages)  # each stage runs FP8 GEMMs
    together = stages[0][recipe] + stages[1][recipe]
    missing, extra = single[recipe] - together, together - single[recipe]
    assert not missing and not extra, (recipe, sorted(w for w, _ in missing.elements()), sorted(w for w, _ in extra.elements()))
