"""[model].hidden_dropout and attention_dropout: masks drawn from each element's global sample, token and
channel (attention: head, query, key), so data parallelism, pipeline stages, micro-batching and
recomputation train as one rank does; the layouts that split an activation (tp, cp, ep) are one error line."""

import pytest
import torch

from pretrain.config import load_config
from pretrain.errors import UsageError
from pretrain.blocks.dropout import attention_with_dropout, keep_mask

STEPS = 3
BASE = ["model.layers=2", f"train.steps={STEPS}", "train.warmup_steps=1", "train.eval_every=0",
        "model.hidden_dropout=0.2", "model.attention_dropout=0.1", "train.global_batch=4"]


def _losses(runs):
    """Each run's losses, one Trainer after the other in these ranks."""
    from pretrain.training.train_loop import Trainer

    out = []
    for overrides in runs:
        t = Trainer(load_config(None, BASE + overrides))
        out.append([t.train_step(s).loss for s in range(STEPS)])
    return out


@pytest.mark.timeout(300)  # alone, it starts the harness's ranks
def test_hidden_dropout_trains_as_one_rank_under_dp_pp_micro_batches_and_recompute(dist_run):
    attention_only = ["model.hidden_dropout=0.0"]
    one, plain, accumulated, attention = dist_run(1, _losses, [
        [], ["model.hidden_dropout=0.0", "model.attention_dropout=0.0"], ["train.micro_batch=1", "model.recompute=full"],
        attention_only])[0]
    assert len({str(one), str(plain), str(attention)}) == 3  # each kind of mask is applied
    assert accumulated == pytest.approx(one, rel=1e-5)
    dp2, pp2, attention_dp2 = dist_run(2, _losses, [["model.recompute=selective"], ["parallel.pp=2"], attention_only])[0]
    assert dp2 == pytest.approx(one, rel=1e-5) and pp2 == pytest.approx(one, rel=1e-5)
    assert attention_dp2 == pytest.approx(attention, rel=1e-5)


def test_the_mask_keeps_1_minus_p_and_depends_on_place_not_on_the_caller():
    where = (1234, 5, 16)
    mask = keep_mask((64, 4, 64), 0.2, where, layer=3, site=0, device=torch.device("cpu"))
    assert abs(mask.float().mean().item() - 0.8) < 0.01
    # samples 18..19 of the same micro-batch, asked for alone (as dp rank 1 of 2 would): the same rows
    assert torch.equal(keep_mask((64, 2, 64), 0.2, (1234, 5, 18), 3, 0, torch.device("cpu")), mask[:, 2:])
    assert not torch.equal(keep_mask((64, 4, 64), 0.2, (1234, 6, 16), 3, 0, torch.device("cpu")), mask)  # next step
    assert not torch.equal(keep_mask((64, 4, 64), 0.2, where, 3, 1, torch.device("cpu")), mask)  # the MLP's site


def test_written_out_attention_is_sdpas_without_drops_and_drops_per_head_query_key():
    torch.manual_seed(0)
    q, k, v = torch.randn(16, 2, 4, 8), torch.randn(16, 2, 2, 8), torch.randn(16, 2, 2, 8)
    ours = attention_with_dropout(q, k, v, 8 ** -0.5, 0.0, (1, 2, 0), 0)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3).repeat_interleave(2, 1), v.permute(1, 2, 0, 3).repeat_interleave(2, 1),
        is_causal=True).permute(2, 0, 1, 3)
    assert torch.allclose(ours, theirs, atol=1e-5)
    one = attention_with_dropout(q, k, v, 8 ** -0.5, 0.5, (1, 2, 0), 0)
    assert torch.equal(attention_with_dropout(q[:, 1:], k[:, 1:], v[:, 1:], 8 ** -0.5, 0.5, (1, 2, 1), 0), one[:, 1:])
    assert not torch.allclose(one, ours)


@pytest.mark.parametrize("sets, words", [
    (["parallel.tp=2"], "got tp=2: set hidden_dropout = 0"),
    (["parallel.cp=2"], "got cp=2"),
    (["train.compile=true"], "got [train].compile"),
    (["model.hidden_dropout=1.0"], "[model].hidden_dropout=1.0 must be in [0, 1)"),
    (["model.attention_dropout=1.5"], "[model].attention_dropout=1.5 must be in [0, 1)"),
    (["model.attention_dropout=0.1", "data.document_mask=true"], "got [data].document_mask: set attention_dropout = 0"),
])
def test_dropout_where_it_would_differ_from_one_rank_is_one_line(sets, words):
    with pytest.raises(UsageError) as e:
        load_config(None, ["model.hidden_dropout=0.1", *sets])
    assert words in str(e.value)
