"""The ``[parallel]`` section: the layout's degrees, schedule, ZeRO strategy and rank order, each validating itself.

The choice lists of what a package implements come from that package (CP modes from par-cp, ZeRO
strategies from par-zero, schedules from par-pp), so a new mode there is a valid key here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from par_cp import MODES as CP_COMM_TYPES
from par_groups import LayoutError, RankGrid
from par_pp import SCHEDULE_NAMES as SCHEDULES
from par_pp import chunk_ranks, chunks_per_rank, split_stages
from par_zero import STRATEGIES as ZERO_STRATEGIES

from .layout import MAX_WORLD
from .rules import MAX_SIZES, _at_most, _choice, _need, _positive
from ..errors import UsageError

RANK_ASSIGNMENTS = ("auto", "strict", "off")  # see pretrain.runtime.rank_assignment


@dataclass(frozen=True)
class ParallelConfig:
    """The layout; dp (and expert dp) are derived from the world size."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    cp_comm_type: str = "p2p"
    hcp: tuple[int, ...] = ()
    ep: int = 1
    etp: int = 0  # 0 = tp (Megatron's default)
    sequence_parallel: bool | None = None  # None = on when tp > 1
    tp_comm_overlap: bool = False  # Megatron's --tp-comm-overlap: SP gathers/scatters as rings under the matmuls
    zero: str = "no_shard"
    hsdp_replicas: int = 1
    schedule: str = "1f1b"
    microbatches: int = 0  # 0 = derived from train.global_batch / (dp * train.micro_batch)
    order: str = "tp-cp-ep-dp-pp"
    # which process plays each grid position (pretrain.runtime.rank_assignment); was [parallel].placement
    rank_assignment: str = "auto"  # auto: best order/permutation on the topology; strict: refuse slow tp/ep/a2a; off
    # Megatron's decoder_first/last_pipeline_num_layers: layers on pp rank 0 / pp-1 (0 = even split)
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    # Dynamic CP (Megatron's --hybrid-context-parallel, see pretrain.training.dynamic_cp): each document over
    # as many of the dp x cp ranks as its length needs, at most max_seq_per_rank tokens per rank.
    dynamic_cp: bool = False
    max_seq_per_rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "hcp", tuple(self.hcp))
        _choice("[parallel].rank_assignment", self.rank_assignment, RANK_ASSIGNMENTS)
        _positive("parallel", self, "tp", "pp", "vpp", "cp", "ep", "hsdp_replicas")
        _positive("parallel", self, "etp", "microbatches", "first_stage_layers", "last_stage_layers", "max_seq_per_rank",
                  allow_zero=True)
        # no grid is larger than the largest world, nor has more chunks than layers: beyond them the checks below loop
        _at_most("parallel", self, dict.fromkeys(("tp", "pp", "cp", "ep", "etp", "hsdp_replicas"), MAX_WORLD)
                 | {"vpp": MAX_SIZES["layers"]})
        if self.dynamic_cp:
            _need(self.cp > 1, "[parallel].dynamic_cp=true needs cp > 1 (it spreads documents over dp x cp ranks); "
                               "got cp=1")
            _need(self.max_seq_per_rank >= 1, "[parallel].dynamic_cp=true needs max_seq_per_rank >= 1 (tokens one "
                                              "rank holds)")
            _need(self.tp == self.pp == self.ep == 1 and self.cp_comm_type == "p2p",
                  f"[parallel].dynamic_cp=true runs with tp=pp=ep=1 and cp_comm_type='p2p' for now (got tp={self.tp}, "
                  f"pp={self.pp}, ep={self.ep}, cp_comm_type={self.cp_comm_type!r})")
        _choice("[parallel].cp_comm_type", self.cp_comm_type, CP_COMM_TYPES)
        _choice("[parallel].zero", self.zero, ZERO_STRATEGIES)
        _choice("[parallel].schedule", self.schedule, SCHEDULES)
        _need(all(isinstance(s, int) and s >= 1 for s in self.hcp), f"[parallel].hcp={list(self.hcp)} must be positive integers")
        if self.cp_comm_type == "a2a+p2p":
            _need(len(self.hcp) == 2 and math.prod(self.hcp) == self.cp,
                  f"[parallel].cp_comm_type='a2a+p2p' needs hcp=[inner, outer] with inner*outer = cp={self.cp}, "
                  f"got hcp={list(self.hcp)}")
        else:
            _need(not self.hcp, f"[parallel].hcp={list(self.hcp)} is only used with cp_comm_type='a2a+p2p'")
        if self.pp > 1 or self.vpp > 1:  # par-pp's rules for a schedule's chunks per rank
            try:
                chunk_ranks(self.schedule, self.pp, self.vpp)
            except ValueError as e:
                raise UsageError(f"[parallel].schedule={self.schedule!r} with vpp={self.vpp}: {e}") from None
        if self.tp_comm_overlap:
            _need(self.tp > 1 and self.sequence_parallel is not False,
                  f"[parallel].tp_comm_overlap=true overlaps sequence parallelism's collectives: it needs tp > 1 and "
                  f"sequence_parallel on, got tp={self.tp}, sequence_parallel={self.sequence_parallel}")
        if self.hsdp_replicas > 1:
            _need(self.zero in ("optim_grads_params", "torch_fsdp2"),
                  f"[parallel].hsdp_replicas={self.hsdp_replicas} needs zero='optim_grads_params' or 'torch_fsdp2' "
                  f"(HSDP shards parameters inside each replica), got zero={self.zero!r}")
        try:  # the order string alone (unknown or repeated tokens); sizes are checked per world
            RankGrid(1, order=self.order)
        except LayoutError as e:
            raise UsageError(f"[parallel].order: {e}") from None

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank holds (par-pp's rule: vpp for interleaved, 2 for the V schedules)."""
        return chunks_per_rank(self.schedule, self.pp, self.vpp)

    @property
    def uneven(self) -> bool:
        return bool(self.first_stage_layers or self.last_stage_layers)

    def chunk_layers(self, num_layers: int) -> list[range]:
        """Layer range of every pipeline chunk in model order (one chunk when pp = 1)."""
        if self.pp == 1:
            return [range(num_layers)]
        ranks = chunk_ranks(self.schedule, self.pp, self.vpp)
        try:
            return split_stages(num_layers, ranks, self.first_stage_layers, self.last_stage_layers)
        except ValueError as e:
            raise UsageError(f"[parallel] layer split: {e}") from None

    def stage_layers(self, num_layers: int) -> list[list[int]]:
        """The layer ids each pipeline rank holds (all its chunks), by pp rank."""
        ranks = chunk_ranks(self.schedule, self.pp, self.vpp) if self.pp > 1 else [0]
        out: list[list[int]] = [[] for _ in range(self.pp)]
        for rank, layers in zip(ranks, self.chunk_layers(num_layers)):
            out[rank] += list(layers)
        return out
