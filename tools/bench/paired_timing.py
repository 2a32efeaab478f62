"""Paired timing for the benchmarks: ours and the peer, step by step in the same processes.

Each repeat runs one step of each, in alternating order (so neither always runs on a warm or a
cold cache), each started after a barrier; a step's time is the slowest rank's (all-reduce MAX).
The first ``warmup`` repeats are discarded. The figure is the median of the per-repeat ratios
ours / peer, with their min and max as the spread: a machine shared with other work slows both
sides of a repeat alike, which a ratio of two separately taken medians does not cancel. The min
and max widen with more repeats; what narrows is ``ci95``, a 95 % confidence interval of that
median (distribution-free: order statistics of the ratios): a win is claimed where it lies below 1.

    pairs = paired_times(ours_step, peer_step, repeats=7, warmup=2)   # inside every rank
    summary = Summary.of(pairs)                                       # ratio, ratio_min, ratio_max
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _timed(step, group) -> float:
    dist.barrier(group)
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def paired_times(ours, peer, repeats: int = 7, warmup: int = 2, group=None) -> list[tuple[float, float]]:
    """[(ours s, peer s)] per timed repeat, each the slowest rank's; the same list on every rank."""
    pairs = []
    for i in range(warmup + repeats):
        if i % 2 == 0:
            t_ours = _timed(ours, group)
            t_peer = _timed(peer, group)
        else:
            t_peer = _timed(peer, group)
            t_ours = _timed(ours, group)
        slowest = torch.tensor([t_ours, t_peer], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            pairs.append((slowest[0].item(), slowest[1].item()))
    return pairs


@dataclass(frozen=True)
class Summary:
    ours_s: float  # median step time
    peer_s: float
    ratio: float  # median of the per-repeat ratios ours / peer
    ratio_min: float
    ratio_max: float
    repeats: int
    ci_low: float = float("nan")  # 95 % confidence interval of the median ratio (median_ci)
    ci_high: float = float("nan")

    @classmethod
    def of(cls, pairs: list[tuple[float, float]]) -> "Summary":
        ratios = [ours / peer for ours, peer in pairs]
        return cls(statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
                   statistics.median(ratios), min(ratios), max(ratios), len(pairs), *median_ci(ratios))

    def spread(self, digits: int = 2) -> str:
        f = lambda x: f"{x:.{digits}f}"  # noqa: E731
        return (f"ratio={f(self.ratio)} ratio_min={f(self.ratio_min)} ratio_max={f(self.ratio_max)} "
                f"ci95={f(self.ci_low)}-{f(self.ci_high)} repeats={self.repeats}")


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A confidence interval of the median of ``values`` that assumes no distribution: the order
    statistics ``(j, n + 1 - j)`` (1-based) with the largest ``j`` whose coverage, 1 - 2 P(B <= j - 1)
    for B ~ Binomial(n, 1/2), is at least ``level``; (min, max) for n <= 8 at 95 % (below 6 that
    covers less than 95 %). n = 31: the 10th and 22nd values (97 %)."""
    xs, n = sorted(values), len(values)
    cdf = lambda k: sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # noqa: E731  P(B <= k)
    cut = 0  # values cut from each end
    while cut + 1 < (n + 1) // 2 and 1 - 2 * cdf(cut + 1) >= level:  # cutting one more still covers
        cut += 1
    return xs[cut], xs[n - 1 - cut]
