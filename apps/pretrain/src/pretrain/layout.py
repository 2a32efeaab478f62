"""The layout one world size resolves to: the rank grid plus sequence parallelism and micro-batching."""

from __future__ import annotations

from dataclasses import dataclass

from par_groups import RankGrid

from .config_rules import _need

MAX_WORLD = 1 << 17  # 131072 ranks: above the largest clusters; beyond it building the rank grid alone takes minutes


@dataclass(frozen=True)
class Layout:
    """What :meth:`Config.validate_world` returns: the :class:`RankGrid` and what the config derives on it."""

    grid: RankGrid
    vpp: int
    chunks_per_rank: int
    sequence_parallel: bool
    micro_batch: int  # sequences per micro-batch on one dp rank
    microbatches: int  # micro-batches per optimizer step on one dp rank

    world_size = property(lambda self: self.grid.world_size)
    tp = property(lambda self: self.grid.tp)
    cp = property(lambda self: self.grid.cp)
    pp = property(lambda self: self.grid.pp)
    dp = property(lambda self: self.grid.dp)
    ep = property(lambda self: self.grid.ep)
    etp = property(lambda self: self.grid.etp)
    edp = property(lambda self: self.grid.edp)
    order = property(lambda self: self.grid.order)
    hcp = property(lambda self: self.grid.hcp or ())


def micro_batching(global_batch: int, micro_batch: int, microbatches: int, dp: int, pp: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) on one dp rank; both set -> must agree."""
    _need(global_batch % dp == 0, f"[train].global_batch={global_batch} is not divisible by dp={dp}")
    per_rank = global_batch // dp
    if micro_batch and microbatches:
        _need(micro_batch * microbatches == per_rank,
              f"[train].micro_batch={micro_batch} x [parallel].microbatches={microbatches} must equal "
              f"global_batch/dp={global_batch}/{dp}={per_rank}")
    elif micro_batch:
        _need(per_rank % micro_batch == 0,
              f"[train].micro_batch={micro_batch} does not divide global_batch/dp={global_batch}/{dp}={per_rank}")
        microbatches = per_rank // micro_batch
    elif microbatches:
        _need(per_rank % microbatches == 0,
              f"[parallel].microbatches={microbatches} does not divide global_batch/dp={global_batch}/{dp}={per_rank}")
        micro_batch = per_rank // microbatches
    else:  # default: one sequence per micro-batch under pp (small bubble), one micro-batch without
        micro_batch = 1 if pp > 1 else per_rank
        microbatches = per_rank // micro_batch
    return micro_batch, microbatches
