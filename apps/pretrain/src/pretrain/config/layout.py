"""The layout one world size resolves to: the parallel degrees, sequence parallelism and micro-batching."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from par_groups import ParallelDims, RankGrid

from .rules import _need

MAX_WORLD = 1 << 17  # 131072 ranks: above the largest clusters; beyond it building the rank grid alone takes minutes


@dataclass(frozen=True)
class Layout(ParallelDims):
    """The layout one world size resolves to (:meth:`Config.validate_world`): the parallel degrees
    (:class:`ParallelDims`, which derives dp and expert dp) and micro-batching, and on demand its
    :class:`RankGrid` (every group's ranks, in ``order``).

    The chain of a rank's position: this layout (what the user asked for) -> its grid (coordinates)
    -> ``pretrain.runtime.rank_assignment`` (which process plays each grid position, possibly in another
    order) -> ``par_groups.create_groups`` (the process groups). The planner's search sizes
    thousands of layouts and never builds their grids."""

    vpp: int = 1
    chunks_per_rank: int = 1
    sequence_parallel: bool = False
    micro_batch: int = 0  # sequences per micro-batch on one dp rank
    microbatches: int = 0  # micro-batches per optimizer step on one dp rank
    order: str = "tp-cp-ep-dp-pp"
    hcp: tuple[int, ...] = ()  # hierarchical CP sizes, innermost first; () = flat CP

    @cached_property
    def grid(self) -> RankGrid:
        """The rank grid (raises par_groups' LayoutError when the degrees do not fit the world)."""
        return RankGrid(self.world_size, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, etp=self.etp,
                        order=self.order, hcp=self.hcp or None)


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
