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


@pytest.fixture(scope="module")
def digests(dist_run):
    stages = dist_run(2, operand_digests, ["parallel.pp=2", "parallel.schedule=1f1b"], timeout=300)
    single = dist_run(1, operand_digests, [], timeout=300)[0]
    return stages, single


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_pp2_stages_quantize_the_single_ranks_operands(digests, recipe):
    stages, single = digests
    assert all(stage[recipe] for stage in stages)  # each stage runs FP8 GEMMs
    together = stages[0][recipe] + stages[1][recipe]
    missing, extra = single[recipe] - together, together - single[recipe]
    assert not missing and not extra, (recipe, sorted(w for w, _ in missing.elements()), sorted(w for w, _ in extra.elements()))
