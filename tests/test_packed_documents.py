"""Packed documents ([data] document_mask + reset_position_ids + eod_mask_loss) train as if each
document ran alone: the trainer's loss and global grad norm, over 2 steps, equal plain PyTorch
running every document of the global batch on its own through the reference model (torch SDPA,
positions from 0) and summing the losses over the kept predictions (none at an EOS), at cp 1,
cp 2 (p2p and a2a), cp 4 (a2a+p2p) and tp 2 x pp 2.

RoPE is relative, so inside a document the positions' origin does not matter: reset_position_ids
alone (attention across documents) is checked against transformers' Llama given position_ids
that restart after every EOS.

Step 2's loss comes after one AdamW update from step 1's gradients, so it checks them element
by element (Adam's first step moves each weight by ~lr * sign of its gradient).
The data: short random documents (up to 19 tokens and the EOS 255 ending each), so a 32-token sequence
packs several and they cross CP shard borders. fp32; measured errors in the test's output.
At one rank every parameter's gradient is compared too (GQA, and MLA with selective recompute).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from layout_runs import one_rank_first_batch, worst_grad_error
from test_trainer_matches_plain_pytorch import COMMON, trainer_and_plain_pytorch

EOS = 255
PACKED = ["data.document_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true",
          "train.seq_len=32", "train.steps=2"]
TOLERANCE = 1e-6


def packed_dataset(prefix) -> str:
    from pretrain.data import write_dataset

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, EOS, size=int(n)).tolist() for n in rng.integers(0, 20, size=2000)]
    write_dataset(prefix, docs, vocab_size=256, eos=EOS)
    return str(prefix)


def each_document_alone(model, sampler, step: int) -> tuple[torch.Tensor, float]:
    """Sum of the per-document losses over the kept predictions of the global batch, over their count."""
    batch = sampler.global_train_batch(step)
    total, kept = 0.0, 0
    for x, y, seg in zip(batch.inputs, batch.labels, batch.input_segments):
        y = y.masked_fill(x == EOS, -100)  # the prediction made at an EOS is dropped
        for doc in seg.unique():
            at = seg == doc
            logits, _ = model(x[at][:, None])  # the document alone: positions 0.., attention within it
            total = total + F.cross_entropy(logits[:, 0], y[at], ignore_index=-100, reduction="sum")
            kept += int((y[at] != -100).sum())
    return total / kept, float(total.detach() / kept)


def packed_run(path, overrides):
    """(the trainer's, the documents-alone) (loss, grad norm) of each step, on one rank."""
    return trainer_and_plain_pytorch(None, [f"data.path={path}", *PACKED, *overrides], each_document_alone, steps=2)


def trainer_run(path, overrides):
    from pretrain.config import load_config
    from pretrain.training.train_loop import Trainer

    trainer = Trainer(load_config(None, [*COMMON, f"data.path={path}", *PACKED, *overrides]))
    return [(r.loss, r.grad_norm) for r in (trainer.train_step(step) for step in range(2))]


LAYOUTS = {
    "cp2-p2p": (2, ["parallel.cp=2"]),
    "cp2-a2a": (2, ["parallel.cp=2", "parallel.cp_comm_type=a2a"]),
    "cp4-a2a+p2p": (4, ["parallel.cp=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hcp=[2,2]"]),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=4"]),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_dataset(tmp_path_factory.mktemp("packed") / "docs")


@pytest.fixture(scope="module")
def cp1(dist_run, data):
    """The trainer on one rank and each document alone (computed once, on one rank)."""
    return dist_run(1, packed_run, data, [], timeout=900)[0]


def _assert_equal(name, results, alone):
    for rank, ours in enumerate(results):
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, alone)):
            print(f"{name} rank {rank} step {step}: rel error loss {abs(loss - ref_loss) / ref_loss:.1e} "
                  f"grad norm {abs(norm - ref_norm) / ref_norm:.1e}")
            assert loss == pytest.approx(ref_loss, rel=TOLERANCE), f"rank {rank} step {step}: loss {loss} vs {ref_loss}"
            assert norm == pytest.approx(ref_norm, rel=TOLERANCE), f"rank {rank} step {step}: norm {norm} vs {ref_norm}"


def test_packed_batch_equals_each_document_alone_on_one_rank(cp1):
    ours, alone = cp1
    _assert_equal("cp1", [ours], alone)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_batch_equals_each_document_alone(dist_run, data, cp1, name):
    world, overrides = LAYOUTS[name]
    _assert_equal(name, dist_run(world, trainer_run, data, overrides, timeout=900), cp1[1])


def restart_after_eos(inputs: torch.Tensor) -> torch.Tensor:
    """Positions counted from 0 again after every EOS (written here, apart from the trainer's)."""
    out = torch.zeros_like(inputs)
    for b, row in enumerate(inputs.tolist()):
        p = 0
        for s, token in enumerate(row):
            out[b, s] = p
            p = 0 if token == EOS else p + 1
    return out


def test_reset_position_ids_alone_matches_transformers_given_those_positions(dist_run, data):
    """5 steps at cp 2. Logits are bitwise those of transformers; the losses agree to 8.6e-8 (so 1e-6),
    the step-0 grad norm to 9.4e-8 (1e-6), later grad norms to 1.7e-6 (so 3e-6): AdamW divides each
    gradient by its own running size, which enlarges the rounding of the smallest ones."""
    from test_train_matches_transformers import STEPS, train_imported, train_transformers

    runs = dist_run(2, train_imported, [f"data.path={data}", "data.reset_position_ids=true", "parallel.cp=2"])
    ref_losses, ref_norms = train_transformers(runs[0][2], restart_after_eos)
    for losses, norms, _ in runs:
        for step in range(STEPS):
            print(f"reset_position_ids step {step}: rel error loss {abs(losses[step] / ref_losses[step] - 1):.1e} "
                  f"grad norm {abs(norms[step] / ref_norms[step] - 1):.1e}")
            assert losses[step] == pytest.approx(ref_losses[step], rel=TOLERANCE), f"step {step}"
            assert norms[step] == pytest.approx(ref_norms[step], rel=TOLERANCE if step == 0 else 3e-6), f"step {step}"


MLA = ["model.attention=mla", "model.kv_heads=8", "model.q_lora_rank=32", "model.kv_lora_rank=16",
       "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.recompute=selective"]


def grads_job(path, overrides):
    """One rank's packed step, gradient by gradient, against each document alone (reference model)."""
    from plain_llama import build_plain
    from pretrain.config import load_config

    cfg = load_config(None, [*COMMON, f"data.path={path}", *PACKED, "train.global_batch=4", *overrides])
    trainer, chunk, grads, batch = one_rank_first_batch(cfg)
    loss = sum(trainer.loss(trainer.forward_chunk(batch, 0, chunk, x, m), y, batch)
               for m, (x, y) in enumerate(zip(batch.inputs, batch.labels)))
    (loss / len(batch.inputs)).backward()
    ref = build_plain(cfg.model, cfg.train.seed)
    want, _ = each_document_alone(ref, trainer.sampler, 0)
    want.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    worst = worst_grad_error(grads, ref_grads)
    return (loss / len(batch.inputs)).item(), want.item(), worst, len(grads), len(ref_grads)


@pytest.mark.parametrize("attention", ["gqa", "mla-recompute"])
def test_packed_gradients_equal_each_document_alone(dist_run, data, attention):
    """Every parameter's gradient (largest error relative to the tensor's largest entry; measured
    7.3e-7 for GQA, 6.4e-7 for MLA with selective recompute: fp32 sums in another order)."""
    loss, want, worst, n, n_ref = dist_run(1, grads_job, data, MLA if attention != "gqa" else [])[0]
    print(f"{attention}: rel error loss {abs(loss / want - 1):.1e}, worst gradient {worst:.1e}")
    assert n == n_ref
    assert loss == pytest.approx(want, rel=TOLERANCE)
    assert worst <= TOLERANCE
