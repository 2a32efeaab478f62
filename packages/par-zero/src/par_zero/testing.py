"""Test helpers (used by the tests and the benchmark): a tiny model with awkward sizes, its batches, the single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from par_groups.param_placement import declare_

STEPS, MICRO, LOCAL_B, MAX_NORM = 5, 2, 3, 0.05
OPT = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def tiny_model(expert: bool = False) -> nn.Sequential:
    """187 trainable params (odd: never divides the DP size), one frozen bias."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))
    m[2].bias.requires_grad_(False)
    if expert:
        for p in m[2].parameters():
            declare_(p, expert=True)
    return m


def batches(world: int):
    g = torch.Generator().manual_seed(1)
    n = LOCAL_B * world
    return [[(torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)) for _ in range(MICRO)] for _ in range(STEPS)]


def reference_params(world: int, norms: list[float] | None = None, optimizer=None, mask: bool = True,
                     steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The same training, one process, full batch, torch.optim.AdamW and torch's clipping.

    ``norms`` (if given) receives each step's global grad norm: AdamW is blind to a constant scale
    on the gradients, so comparing parameters alone would miss a mis-scaled reduction.
    ``optimizer``: ``(param_groups) -> torch.optim.Optimizer`` in place of AdamW; ``mask=False``
    decays every param (to show that a test can tell the mask's absence)."""
    model = tiny_model()
    trained = [p for p in model.parameters() if p.requires_grad]
    # two groups, as nanoGPT and Megatron: no weight decay on biases (1-D)
    groups = [{"params": [p for p in trained if p.dim() >= 2 or not mask]},
              {"params": [p for p in trained if p.dim() < 2 and mask], "weight_decay": 0.0}]
    opt = (optimizer or (lambda g: torch.optim.AdamW(g, foreach=False, **OPT)))([g for g in groups if g["params"]])
    for step in batches(world)[:steps]:
        for x, y in step:
            (nn.functional.mse_loss(model(x), y) / MICRO).backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM)
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def train_parallel(dp, world: int, rank: int, steps: int = STEPS, clip: bool = True, start: int = 0,
                   sync_every_backward: bool = False) -> list[float]:
    """Train like :func:`reference_params` on this rank's slice of each batch (from step ``start``); returns grad norms.
    ``sync_every_backward``: no ``no_sync``, so every micro-batch's backward reduces (as torch DDP allows)."""
    norms = []
    for step in batches(world)[start:start + steps]:
        for i, (x, y) in enumerate(step):
            sl = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
            ctx = dp.no_sync() if i < MICRO - 1 and not sync_every_backward else _null()
            with ctx:
                (nn.functional.mse_loss(dp(x[sl]).float(), y[sl]) / MICRO).backward()
        if clip:
            norms.append(float(dp.clip_grad_norm_(MAX_NORM)))
        dp.step()
        dp.zero_grad()
    return norms


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def hsdp_groups(inner: int):
    """Inner groups of consecutive ranks, outer groups across them (created on every rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine_inner = mine_outer = None
    for start in range(0, world, inner):
        g = dist.new_group(list(range(start, start + inner)))
        if start <= rank < start + inner:
            mine_inner = g
    for k in range(inner):
        g = dist.new_group(list(range(k, world, inner)))
        if rank % inner == k:
            mine_outer = g
    return mine_inner, mine_outer
