"""A declared routing sizes the MoE layer's data-dependent shapes on fake tensors (no values).

``DeclaredRouting`` is what ``pretrain plan --simulate`` gives every MoE layer: fake tensors carry
no router choices, so ``nonzero``/``bincount``/split sizes cannot be read from the data. Checked
here: the declared counts themselves, and that a layer under ``FakeTensorMode`` runs forward and
backward with exactly the declared number of rows reaching its experts.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from par_moe import DeclaredRouting, MoEConfig, MoELayer


def test_declared_counts_conserve_pairs_and_give_the_hot_expert_its_shares():
    balanced = DeclaredRouting().pairs(tokens=1000, top_k=8, num_experts=64)
    assert sum(balanced) == 8000 and set(balanced) == {125}
    hot = DeclaredRouting(imbalance=4.0).pairs(tokens=1000, top_k=8, num_experts=64)
    assert sum(hot) == 8000 and hot[0] == 500 and max(hot[1:]) - min(hot[1:]) <= 1
    assert DeclaredRouting(imbalance=8.0).pairs(100, 8, 64)[0] == 100  # at most one pair per token
    assert DeclaredRouting().pairs(1000, 8, 64, capacity=100) == [100] * 64
    # EP rank 0 of 4 holds experts 0..15: it receives every source's pairs for them
    sizes = DeclaredRouting(imbalance=4.0).sizes(1000, 8, 64, ep=4, ep_rank=0)
    assert sizes.local == [4 * p for p in hot[:16]] and sizes.receive == [sizes.send[0]] * 4
    assert sizes.send == [min(1000, sum(hot[16 * r:16 * (r + 1)])) for r in range(4)]


@pytest.mark.parametrize("capacity_factor, dispatcher", [(None, "alltoall"), (0.5, "alltoall"), (None, "allgather")])
def test_fake_tensor_layer_runs_the_declared_rows_through_its_experts(capacity_factor, dispatcher):
    cfg = MoEConfig(hidden=16, ffn_hidden=8, num_experts=8, top_k=2, capacity_factor=capacity_factor,
                    dispatcher=dispatcher, num_shared_experts=1, seq_aux_loss_coeff=1e-3)
    routing = DeclaredRouting(imbalance=3.0)
    with FakeTensorMode():
        layer = MoELayer(cfg, routing=routing)
        rows = []
        layer.experts.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
        x = torch.randn(32, 2, 16, requires_grad=True)  # [S, B, H]: 64 tokens
        y, aux = layer(x)
        (y.sum() + aux).backward()
        assert y.shape == x.shape and x.grad.shape == x.shape
    capacity = cfg.capacity(64)  # 0.5: 8 pairs per expert, below the hot expert's 48
    want = 64 * 2 if capacity is None else sum(min(p, capacity) for p in routing.pairs(64, 2, 8))
    assert rows == [want] and (capacity is None or want < 64 * 2)
