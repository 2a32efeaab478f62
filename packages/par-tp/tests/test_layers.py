"""Layers, loss, collectives and sharding of par-tp against plain single-device torch.

One 4-rank job checks every case at TP = 1, 2, 4 (sub-groups of the world) and returns the
relative errors; the tests below assert on them.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from par_groups import CommRecorder
from par_tp import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPAttention,
    VocabParallelEmbedding,
    gather_from_sequence_parallel,
    scatter_to_sequence_parallel,
    vocab_parallel_cross_entropy,
)
from par_tp.testing import relative_error, sum_partial_grads_of_, tp_group_of_size

TPS = (1, 2, 4)
S, B, H, V = 8, 2, 12, 16




def loss_cases(group, tp, r, errs):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(S, B, V, generator=g) * 3
    ids = torch.randint(0, V, (S, B), generator=g)
    for smoothing in (0.0, 0.1):
        for ignore in (-100, 7):
            target = ids.clone()
            target[0, 0] = target[3, 1] = ignore  # 7 is also an ordinary id elsewhere (same value)
            for reduction in ("mean", "sum", "none"):
                full = logits.clone().requires_grad_(True)
                ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), label_smoothing=smoothing,
                                      ignore_index=ignore, reduction=reduction)
                ref = ref.view(S, B) if reduction == "none" else ref
                up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
                (ref * up).sum().backward()
                shard = logits.chunk(tp, -1)[r].clone().requires_grad_(True)
                with CommRecorder() as rec:
                    loss = vocab_parallel_cross_entropy(shard, target, group, smoothing, ignore, reduction)
                (loss * up).sum().backward()
                key = f"loss[tp={tp}-ls={smoothing}-ignore={ignore}-{reduction}]"
                errs[key] = max(relative_error(loss.detach(), ref.detach()), relative_error(shard.grad, full.grad.chunk(tp, -1)[r]))
                errs[key + "-collectives"] = rec.ops() if tp > 1 else []


def linear_cases(group, tp, r, errs):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(S, B, H, generator=g)
    w, b = torch.randn(8, H, generator=g), torch.randn(8, generator=g)
    up = torch.randn(S, B, 8, generator=g)
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    (F.linear(xr, wr, br) * up).sum().backward()

    col = ColumnParallelLinear.from_full(w, group, full_bias=b, gather_output=True)
    xc = x.clone().requires_grad_(True)
    out = col(xc)
    (out * up).sum().backward()
    errs[f"column-gather_output[tp={tp}]"] = max(
        relative_error(out.detach(), F.linear(x, w, b)), relative_error(xc.grad, xr.grad),
        relative_error(col.weight.grad, wr.grad.chunk(tp, 0)[r]), relative_error(col.bias.grad, br.grad.chunk(tp, 0)[r]),
        relative_error(col.full_weight(), w))

    for sp in (False, True):
        row = RowParallelLinear.from_full(w, group, full_bias=b, input_is_parallel=sp, sequence_parallel=sp)
        xi = (x.chunk(tp, -1)[r] if sp else x).clone().requires_grad_(True)
        out = row(xi)
        o_up = up.chunk(tp, 0)[r] if sp else up
        (out * o_up).sum().backward()
        sum_partial_grads_of_(row)
        ref_out = F.linear(x, w, b)
        errs[f"row-{'sp' if sp else 'full_input'}[tp={tp}]"] = max(
            relative_error(out.detach(), ref_out.chunk(tp, 0)[r] if sp else ref_out),
            relative_error(xi.grad, xr.grad.chunk(tp, -1)[r] if sp else xr.grad),
            relative_error(row.weight.grad, wr.grad.chunk(tp, 1)[r]), relative_error(row.bias.grad, br.grad),
            relative_error(row.full_weight(), w))


def embedding_cases(group, tp, r, errs):
    g = torch.Generator().manual_seed(4)
    table = torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (S, B), generator=g)
    up = torch.randn(S, B, H, generator=g)
    tr = table.clone().requires_grad_(True)
    ref = F.embedding(ids, tr)
    (ref * up).sum().backward()
    for sp in (False, True):
        emb = VocabParallelEmbedding.from_full(table, group, sequence_parallel=sp)
        out = emb(ids)
        (out * (up.chunk(tp, 0)[r] if sp else up)).sum().backward()
        errs[f"embedding-{'sp' if sp else 'nosp'}[tp={tp}]"] = max(
            relative_error(out.detach(), ref.detach().chunk(tp, 0)[r] if sp else ref.detach()),
            relative_error(emb.weight.grad, tr.grad.chunk(tp, 0)[r]), relative_error(emb.full_weight(), table))


def sequence_entry_exit_cases(group, tp, r, errs):
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    with CommRecorder() as rec:
        y = gather_from_sequence_parallel(scatter_to_sequence_parallel(x, group) * 3, group, output_grad_is_partial=False)
        (y * y).sum().backward()  # replicated consumer: every rank holds the full gradient
    errs[f"sp-entry-exit[tp={tp}]"] = max(relative_error(y.detach(), 3 * x.detach()), relative_error(x.grad, 18 * x.detach()))
    errs[f"sp-entry-exit-collectives[tp={tp}]"] = rec.ops()


def attention_roundtrip_cases(group, tp, r, errs):
    for hq, hkv in ((4, 4), (4, 2), (4, 1)):
        g = torch.Generator().manual_seed(6)
        full = {"wq": torch.randn(hq * 3, H, generator=g), "wk": torch.randn(hkv * 3, H, generator=g),
                "wv": torch.randn(hkv * 3, H, generator=g), "wo": torch.randn(H, hq * 3, generator=g)}
        attn = TPAttention(H, hq, hkv, group, head_dim=3).load_full_(**full)
        back = attn.full_weights()
        errs[f"attention-full-weights-roundtrip[tp={tp}-{hq}x{hkv}]"] = max(relative_error(back[k], full[k]) for k in full)


def run_layer_cases():
    groups = {tp: tp_group_of_size(tp) for tp in TPS}
    errs = {}
    for tp in TPS:
        group, r = groups[tp], dist.get_rank(groups[tp])
        for fn in (loss_cases, linear_cases, embedding_cases, sequence_entry_exit_cases, attention_roundtrip_cases):
            fn(group, tp, r, errs)
    errs["errors"] = run_error_cases(groups)
    return errs


def expect_error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def run_error_cases(groups):
    g4, g2 = groups[4], groups[2]
    x = torch.randn(6, 1, 8)
    return {
        "heads": expect_error(lambda: TPAttention(24, 6, 6, g4)),
        "kv_heads": expect_error(lambda: TPAttention(24, 6, 4, g2)),
        "kv_split": expect_error(lambda: TPAttention(96, 24, 6, g4)),
        "vocab": expect_error(lambda: VocabParallelEmbedding(10, 4, g4)),
        "column": expect_error(lambda: ColumnParallelLinear(8, 6, g4)),
        "gather_sp": expect_error(lambda: ColumnParallelLinear(8, 8, g4, gather_output=True, sequence_parallel=True)),
        "row_sp": expect_error(lambda: RowParallelLinear(8, 8, g4, input_is_parallel=False, sequence_parallel=True)),
        "seq": expect_error(lambda: ColumnParallelLinear(8, 8, g4, sequence_parallel=False)(scatter_to_sequence_parallel(x, g4))),
        "reduction": expect_error(lambda: vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), g4, reduction="avg")),
    }


@pytest.fixture(scope="module")
def layer_results(dist_run):
    return dist_run(4, run_layer_cases)


def run_layer_cases_keys():
    keys = []
    for tp in TPS:
        keys += [f"loss[tp={tp}-ls={ls}-ignore={ig}-{red}]" for ls in (0.0, 0.1) for ig in (-100, 7) for red in ("mean", "sum", "none")]
        keys += [f"column-gather_output[tp={tp}]", f"row-full_input[tp={tp}]", f"row-sp[tp={tp}]",
                 f"embedding-nosp[tp={tp}]", f"embedding-sp[tp={tp}]", f"sp-entry-exit[tp={tp}]"]
        keys += [f"attention-full-weights-roundtrip[tp={tp}-{hq}x{hkv}]" for hq, hkv in ((4, 4), (4, 2), (4, 1))]
    return keys


@pytest.mark.parametrize("key", run_layer_cases_keys())
def test_matches_single_device(layer_results, key):
    for rank, errs in enumerate(layer_results):
        assert errs[key] <= 1e-5, f"rank {rank}: {key} relative error {errs[key]:.3g}"


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_loss_uses_two_all_reduces(layer_results, tp):
    for ls in (0.0, 0.1):
        assert layer_results[0][f"loss[tp={tp}-ls={ls}-ignore=-100-mean]-collectives"] == ["all_reduce", "all_reduce"]


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_entry_exit_collectives(layer_results, tp):
    # forward: all-gather; backward of a replicated consumer: a split (no comm) then the scatter's all-gather
    assert layer_results[0][f"sp-entry-exit-collectives[tp={tp}]"] == ["all_gather", "all_gather"]


def test_clear_errors(layer_results):
    msgs = layer_results[0]["errors"]
    assert "tp=4 does not divide num_heads=6" in msgs["heads"] and "[1, 2, 3, 6]" in msgs["heads"]
    assert "num_kv_heads=4 does not divide num_heads=6" in msgs["kv_heads"]
    assert "tp=4 and num_kv_heads=6" in msgs["kv_split"] and "replicate" in msgs["kv_split"]
    assert "tp=4 does not divide num_embeddings (vocabulary size)=10" in msgs["vocab"]
    assert "tp=4 does not divide out_features=6" in msgs["column"]
    assert "gather_output=True with sequence_parallel=True" in msgs["gather_sp"]
    assert "requires input_is_parallel=True" in msgs["row_sp"]
    assert "sequence length 6 is not divisible by the tensor-parallel size 4" in msgs["seq"]
    assert "reduction='avg'" in msgs["reduction"]


def embedding_under_fully_shard():
    """One rank (tp 1): the embedding as its own FSDP2 unit, as zero="torch_fsdp2" wraps it."""
    import warnings

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    emb = VocabParallelEmbedding(V, H, dist.group.WORLD)
    full = emb.weight.detach().clone().requires_grad_(True)
    ids = torch.randint(0, V, (S, B))
    fully_shard(emb, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = emb(ids)
    (out * torch.arange(H)).sum().backward()
    (F.embedding(ids, full) * torch.arange(H)).sum().backward()
    return [str(w.message) for w in caught], relative_error(emb.weight.grad.full_tensor(), full.grad)


def test_fsdp2_sees_no_view_from_the_embedding_and_its_gradient_is_plain_torchs(dist_run):
    [(warned, err)] = dist_run(1, embedding_under_fully_shard)
    assert not [w for w in warned if "view" in w], warned
    assert err == 0
