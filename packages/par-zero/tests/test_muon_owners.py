"""Owner-balanced Newton-Schulz: each whole matrix is orthogonalized by one rank of the sharding group.

Over gloo ranks of dp = 4, per strategy, 3 Muon steps (fp32 Newton-Schulz) on a model of matrices of
different sizes and an ``[E, F, H]`` expert tensor give the params of one device at 1e-6 (the one-rank
Muon is torch.optim.Muon bit for bit: test_muon.py), and the ranks together run Newton-Schulz once
per matrix per step (each expert's matrix counted once), not once per rank holding a piece.
"""

import pytest
import torch

from par_zero.muon_owners import assign_owners
from par_zero.newton_schulz import ns_flops

WORLD, STEPS, E = 4, 3, 5


def test_assign_owners_is_largest_first_onto_least_loaded():
    owners, loads = assign_owners([3, 7, 3, 5, 2, 2], 3)
    # 7 -> r0; 5 -> r1; 3 (unit 0) -> r2; 3 (unit 2) -> r2 (3 < 5 < 7); 2 -> r1 (5); 2 -> r2 (6 < 7)
    assert owners == [2, 0, 2, 1, 1, 2] and loads == [7, 7, 8]
    assert assign_owners([], 2) == ([], [0, 0])
    with pytest.raises(ValueError, match="ranks=0"):
        assign_owners([1], 0)


def test_ns_flops_is_the_three_matmuls_per_step():
    # m = 2 (short side), n = 8: X X^T 2*4*8, gram gram 2*8, gram_update X 2*4*8 = 144 per step
    assert ns_flops((8, 2), 5) == ns_flops((2, 8), 5) == ns_flops((7, 2, 8), 5) == 5 * 144


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(E, 8, 24) / 5)  # E matrices

    def forward(self, h):
        return torch.einsum("nh,efh->n", h, self.w)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(12, 24), torch.nn.Linear(24, 24, bias=False), torch.nn.Linear(24, 6)
        self.experts = Experts()

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.c(h).sum(-1) + self.experts(h)


def steps(strategy: str):
    import torch.distributed as dist

    import par_zero.muon as muon
    from par_zero import DataParallel

    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(WORLD)][rank]
    calls = []
    ns = muon.zeropower_via_newtonschulz
    muon.zeropower_via_newtonschulz = lambda m, *a: (calls.append(tuple(m.shape)), ns(m, *a))[1]
    try:
        kw = dict(optimizer="Muon", lr=0.02, weight_decay=0.1, bucket_mb=0.001, optimizer_args={"ns_dtype": "fp32"})
        dp, one = DataParallel(Model(), None, strategy, **kw), DataParallel(Model(), solo, "no_shard", **kw)
        torch.manual_seed(1)
        for _ in range(STEPS):
            x = torch.randn(4 * WORLD, 12)
            for m, batch in ((dp, x[4 * rank:4 * rank + 4]), (one, x)):
                m(batch).square().mean().backward()
                calls.clear()
                m.step()
                m.zero_grad()
                if m is dp:
                    mine = len(calls)
    finally:
        muon.zeropower_via_newtonschulz = ns
    got, want = dp.full_parameters(), one.full_parameters()  # ZeRO-3's params at rest are shards
    errors = [((got[k] - want[k]).norm() / want[k].norm()).item() for k in want]
    return errors, mine, len(dp.buckets), dp.optimizer.ns_imbalance


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_owners_match_one_device_and_run_each_matrix_once(dist_run, strategy):
    results = dist_run(WORLD, steps, strategy)
    for errors, *_ in results:
        assert max(errors) <= 1e-6, errors
    assert results[0][2] > 1  # small buckets: the owners are assigned over several buckets at once
    # one step's Newton-Schulz calls over the ranks: a, b, c and the E experts, each once
    assert sum(r[1] for r in results) == 3 + E, [r[1] for r in results]
    assert all(r[1] > 0 for r in results)  # every rank owns some


def test_state_is_one_momentum_per_muon_param_and_loads_back_packed(dist_run):
    assert dist_run(1, packed_state)[0]


def packed_state():
    from par_zero import DataParallel
    from par_zero.muon import KINDS

    kw = dict(optimizer="Muon", lr=0.02, bucket_mb=0.001)
    dp, fresh = DataParallel(Model(), None, "no_shard", **kw), DataParallel(Model(), None, "no_shard", **kw)
    for _ in range(2):
        dp(torch.randn(4, 12)).square().mean().backward()
        dp.step()
        dp.zero_grad()
    matrices = sum(p.numel() for p in dp.module.parameters() if p.dim() >= 2)
    others = sum(p.numel() for p in dp.module.parameters() if p.dim() < 2)
    assert sum(t.numel() for t in dp.optimizer.state_tensors()) == matrices + 2 * others  # not 3 per param
    opt, new = dp.optimizer, fresh.optimizer
    new.prepare_load(KINDS)  # as a checkpoint load: fill the unpacked ranges, then pack them
    stepped = dict.fromkeys(KINDS, False)
    for b, nb in zip(dp.buckets, fresh.buckets):
        for kind in KINDS:
            full = opt.range_state(b, kind)
            assert full.numel() == b.opt_hi - b.opt_lo
            stepped[kind] |= bool(full.any())
            new.range_state(nb, kind).copy_(full)
    new.finish_load({})
    assert all(stepped.values())
    return all(torch.equal(new.state[nb][k], opt.state[b][k]) for b, nb in zip(dp.buckets, fresh.buckets)
               for k in KINDS)
