"""par-zero's Muon with bf16 Newton-Schulz is torch.optim.Muon (matrices) + torch.optim.AdamW (the rest), bit for bit;
so is its step with every collective before any state changes (what fault tolerance runs)."""

import pytest


def muon_against_torch(adjust_lr_fn, collectives_first=False):
    import torch

    from par_zero import DataParallel

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ref = [p.detach().clone().requires_grad_() for p in m.parameters()]
    dp = DataParallel(m, None, "no_shard", optimizer="Muon", lr=0.02, weight_decay=0.1,
                      optimizer_args={"adjust_lr_fn": adjust_lr_fn})
    dp.optimizer_state.collectives_first = collectives_first
    muon = torch.optim.Muon([ref[0], ref[2]], lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW([ref[1], ref[3]], lr=0.02, weight_decay=0.0)
    for _ in range(5):
        x = torch.randn(5, 8)
        dp(x).square().sum().backward()
        dp.step()
        dp.zero_grad()
        y = x
        for i in range(2):
            y = torch.nn.functional.linear(y, ref[2 * i], ref[2 * i + 1])
        y.square().sum().backward()
        for o in (muon, adamw):
            o.step()
            o.zero_grad()
    return all(a.equal(b) for a, b in zip(m.parameters(), ref))


@pytest.mark.parametrize("adjust_lr_fn,collectives_first", [("original", False), ("match_rms_adamw", True)])
def test_muon_bf16_is_torch_muon_bitwise(dist_run, adjust_lr_fn, collectives_first):
    assert dist_run(1, muon_against_torch, adjust_lr_fn, collectives_first)[0]
