"""Newton-Schulz FLOPs per rank of one Muon step: owners (now) against every holder of a piece (before).

Before the owners (par_zero/muon_owners.py) every rank whose optimizer range met a param ran
Newton-Schulz on all of its matrices; now each matrix has one owner in the data-parallel group.
The rank models are built as the trainer builds them, on fake tensors in a fake world
(tests/test_muon_owner_balance.py's cases); nothing runs, the FLOPs are counted (ns_flops).

    uv run python tools/bench/muon_ns_owners.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import par_zero.muon as muon  # noqa: E402
from par_groups.param_placement import placement_of  # noqa: E402
from par_zero.newton_schulz import ns_flops  # noqa: E402
from test_muon_owner_balance import CASES, NS_STEPS, owners_of  # noqa: E402


def before(opt, world: int) -> list[int]:
    """Per rank: the FLOPs of every matrix of every Muon param meeting its optimizer range (ZeRO-1's)."""
    out = [0] * world
    for b in opt.buckets:
        shard = b.N // world
        for p in opt.matrices[b]:
            lo = opt.offset[b][p]
            cost = ns_flops(placement_of(p).full_shape, NS_STEPS) * (p.numel() // (p.shape[-2] * p.shape[-1]))
            for r in range(world):
                if lo < (r + 1) * shard and lo + p.numel() > r * shard:
                    out[r] += cost
    return out


def main() -> None:
    built = []
    init = muon.DistributedMuon.__init__
    muon.DistributedMuon.__init__ = lambda self, *a, **k: (init(self, *a, **k), built.append(self))[0]
    for case, (preset, world, overrides) in CASES.items():
        _, owners = owners_of(preset, world, overrides)
        old, new = before(built[-1], world), owners[0].loads
        print(f"{case}: per-rank Newton-Schulz FLOPs before max {max(old):.3g} (mean {sum(old) / world:.3g}); "
              f"owners max {max(new):.3g} (mean {sum(new) / world:.3g}, max/mean {max(new) * world / sum(new):.5f}); "
              f"max before / max now {max(old) / max(new):.2f}")


if __name__ == "__main__":
    main()
