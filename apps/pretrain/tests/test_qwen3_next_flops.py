"""The FLOPs ``plan`` and MFU count for a Qwen3-Next layer are the layer's own: torch's FlopCounterMode
counts every matmul of a Gated DeltaNet layer's forward and backward (the projections, the chunked
delta rule's chunk products, the unit-lower inverse's squarings) and the declaration
(``models/qwen3_next/flops.py``, 6 x the projections' weights + the rule) matches it within 1 % (0.3 % at 512 tokens): the
counter also sees the ends of the state's chain (the first chunk's zero state and the last chunk's
unused final state get no gradient), which the per-token figure counts as interior chunks. A layer
of full softmax attention would count ``seq_len`` times more (quadratic)."""

import pytest

MODEL = ["model.attention=qwen3_next", "model.full_attention_interval=2", "model.hidden=64", "model.heads=4",
         "model.kv_heads=2", "model.linear_key_heads=2", "model.linear_value_heads=4", "model.linear_key_dim=32",
         "model.linear_value_dim=32"]
LENGTHS = (512, 1024)


def counted_job(lengths):
    """Per sequence length: the matmul FLOPs FlopCounterMode counts in one GDN layer's forward + backward
    (batch 1), and the layer's projection weights."""
    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from par_groups import RankGrid, create_groups
    from pretrain.blocks.context import ChunkContext
    from pretrain.config import load_config
    from pretrain.models.qwen3_next.gdn import TPGatedDeltaNet

    model = load_config(None, MODEL).model
    groups = create_groups(RankGrid(dist.get_world_size()))
    out = {}
    for s in lengths:
        layer = TPGatedDeltaNet(model, ChunkContext(groups, False, "p2p", s, "none"))
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape) * 0.1)
        x = torch.randn(s, 1, model.hidden, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            layer(x).sum().backward()
        weights = sum(m.weight.numel() for m in (layer.in_proj_qkvz, layer.in_proj_ba, layer.out_proj))
        out[s] = counter.get_total_flops(), weights
    return out


@pytest.fixture(scope="module")
def counted(dist_run):
    return dist_run(1, counted_job, LENGTHS)[0]


@pytest.mark.parametrize("seq_len", LENGTHS)
def test_declared_gdn_flops_match_the_layer_counted_by_torch(counted, seq_len):
    from pretrain.config import load_config
    from pretrain.models.qwen3_next.flops import linear_core_flops

    model = load_config(None, MODEL).model
    flops, weights = counted[seq_len]
    declared = seq_len * (6.0 * weights + linear_core_flops(model, seq_len))
    assert declared == pytest.approx(flops, rel=0.01), (declared, flops)


def test_plan_counts_the_linear_layers_linear_in_seq_len():
    """plan's FLOPs per token: 6 x the matmul weights, the full layers' quadratic attention and the linear
    layers' rule, not softmax attention on every layer."""
    from pretrain.config import load_config
    from pretrain.models.qwen3_next.flops import linear_core_flops
    from pretrain.sizing.flops import matmul_params_per_token, training_flops_per_token

    for s in (4096, 32768):
        m = load_config(None, MODEL + ["model.layers=8", f"train.seq_len={s}"]).model
        core = 3.0 * 4 * s * m.heads * 2 * m.head_dim + 4 * linear_core_flops(m, s)  # 4 full, 4 linear layers
        assert training_flops_per_token(m, s) == pytest.approx(6.0 * matmul_params_per_token(m) + core, rel=1e-12)
