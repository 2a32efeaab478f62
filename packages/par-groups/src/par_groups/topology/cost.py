"""The cost model that ranks placements: bytes each rank sends per step, per group type.

Time of a group type = its bytes / the bandwidth of the slowest link any of its groups crosses,
times the share of it that is exposed (not hidden behind compute, :data:`EXPOSED`); a
placement's cost is the sum over group types. The volumes follow the usual ring formulas
(all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all (n-1)/n of the tensor) for a
Megatron-style transformer step; they only need to be right in proportion, since they rank
orders of one layout against each other.

Group types: tp, cp (its comm type, or hcp0 = all-to-all inner level and hcp1.. = p2p rings),
ep, etp (expert TP), dp (dense gradients; dp_cp when cp > 1, since they are reduced over dp x cp),
edp (expert gradients), pp.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..grid import RankGrid

# The single-level CP modes. par-cp's fourth, "a2a+p2p", is two levels: it is the grid's ``hcp`` here
# (level hcp0 all-to-all, hcp1.. p2p rings), not a ``cp_comm`` value.
CP_COMM_TYPES = ("p2p", "a2a", "allgather")
# Share of each group type's time on the critical path. TP, all-to-all and expert traffic sits
# between dependent matmuls; a CP ring overlaps each hop with attention on the previous block,
# gradient reduction overlaps the backward pass, pipeline sends overlap other microbatches.
EXPOSED = {"tp": 1.0, "a2a": 1.0, "allgather": 1.0, "ep": 1.0, "etp": 1.0, "p2p": 0.5,
           "dp": 0.5, "dp_cp": 0.5, "edp": 0.5, "pp": 0.5}


@dataclass(frozen=True)
class Workload:
    """What one training step moves. Defaults: a 7B-class model, 4k tokens, 8 microbatches.

    ``moe_layers`` defaults to every layer when ep > 1 (else none); ``experts`` to max(8, ep).
    ``cp_comm`` is the CP communication type when no hierarchical CP is given.
    """

    hidden: int = 4096
    ffn_hidden: int | None = None
    layers: int = 32
    seq_len: int = 4096
    micro_batch: int = 1
    microbatches: int = 8
    vocab: int = 32000
    moe_layers: int | None = None
    experts: int | None = None
    expert_ffn_hidden: int | None = None  # width of one routed expert; default ffn_hidden
    topk: int = 2
    cp_comm: str = "p2p"
    act_bytes: int = 2
    grad_bytes: int = 4
    # Hybrid models: the layers whose CP moves K and V (None: every layer); per micro-batch, the whole model,
    # what one rank of the other (recurrent) layers sends along a CP ring (their states) and in all-to-alls
    cp_kv_layers: int | None = None
    cp_state_bytes: float = 0.0
    cp_a2a_bytes: float = 0.0

    def __post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in ("hidden", "layers", "seq_len", "micro_batch", "microbatches",
                                                "vocab", "topk", "act_bytes", "grad_bytes")}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"workload sizes must be positive integers, got {bad}")
        if self.cp_comm not in CP_COMM_TYPES:
            hint = "; a2a+p2p is hierarchical: give the grid hcp=[inner, outer]" if self.cp_comm == "a2a+p2p" else ""
            raise ValueError(f"cp_comm={self.cp_comm!r}; use one of {', '.join(CP_COMM_TYPES)}{hint}")
        if self.moe_layers is not None and not 0 <= self.moe_layers <= self.layers:
            raise ValueError(f"moe_layers={self.moe_layers} must be within 0..layers={self.layers}")


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def exposed_share(name: str, grid: RankGrid, work: Workload) -> float:
    """Critical-path share of a group type's traffic (see :data:`EXPOSED`)."""
    if name.startswith("hcp"):
        return EXPOSED["a2a" if name == "hcp0" else "p2p"]
    if name == "cp":
        return EXPOSED[work.cp_comm]
    return EXPOSED[name]


def bytes_per_step(grid: RankGrid, work: Workload) -> dict[str, float]:
    """Bytes one rank sends per step over each group type of ``grid`` (types of size 1 omitted)."""
    w = work
    t, cp, pp = grid.tp, grid.cp, grid.pp
    m = w.microbatches
    moe_layers = w.moe_layers if w.moe_layers is not None else (w.layers if grid.ep > 1 else 0)
    dense_layers = w.layers - moe_layers
    experts = w.experts if w.experts is not None else max(8, grid.ep)
    ffn = w.ffn_hidden or 4 * w.hidden
    tokens = w.seq_len // cp * w.micro_batch  # this rank's CP shard of one microbatch
    act = tokens * w.hidden * w.act_bytes  # one [S/cp, B, H] activation
    per_stage = w.layers / pp
    moe_per_stage = moe_layers / pp
    out: dict[str, float] = {}
    if t > 1:  # 2 all-reduces (or AG + RS with SP) forward, 2 backward, per layer
        out["tp"] = m * per_stage * 4 * 2 * _ring(t) * act
    kv = act / t  # one rank's K or V shard after TP splits the heads
    kv_per_stage = (w.layers if w.cp_kv_layers is None else w.cp_kv_layers) / pp
    cp_levels: list[tuple[str, int, str]] = []
    if grid.hcp:
        cp_levels = [(f"hcp{i}", n, "a2a" if i == 0 else "p2p") for i, n in enumerate(grid.hcp)]
    elif cp > 1:
        cp_levels = [("cp", cp, w.cp_comm)]
    for name, n, kind in cp_levels:
        if n < 2:
            continue
        if kind == "a2a":  # q, k, v in and the output back, forward and backward
            out[name] = m * kv_per_stage * 8 * _ring(n) * kv + m * w.cp_a2a_bytes / pp
        elif kind == "p2p":  # K, V around the ring forward; K, V and dK, dV backward
            out[name] = m * kv_per_stage * 6 * (n - 1) * kv
        else:  # all-gather K, V forward, reduce-scatter dK, dV backward
            out[name] = m * kv_per_stage * 4 * (n - 1) * kv
        if kind != "a2a" and name in ("cp", "hcp1"):  # the recurrent layers' states pass along the (outer) ring
            out[name] += m * w.cp_state_bytes / pp
    routed = w.topk * act / t  # tokens this rank dispatches (SP splits them over tp)
    if grid.ep > 1 and moe_per_stage:  # dispatch + combine, forward and backward
        out["ep"] = m * moe_per_stage * 4 * _ring(grid.ep) * routed
    if grid.etp > 1 and moe_per_stage:  # gather tokens for the expert shards, scatter results
        out["etp"] = m * moe_per_stage * 4 * _ring(grid.etp) * w.topk * act
    dense_params = (dense_layers * (4 * w.hidden**2 + 2 * w.hidden * ffn) + moe_layers * 4 * w.hidden**2
                    + 2 * w.vocab * w.hidden) / (pp * t)
    if grid.dp * cp > 1:  # gradients all-reduced over dp x cp once per step
        out["dp_cp" if cp > 1 else "dp"] = 2 * _ring(grid.dp * cp) * dense_params * w.grad_bytes
    expert_params = moe_layers * (experts / grid.ep) * 2 * w.hidden * (w.expert_ffn_hidden or ffn) / (pp * grid.etp)
    if grid.edp > 1 and expert_params:
        out["edp"] = 2 * _ring(grid.edp) * expert_params * w.grad_bytes
    if pp > 1:  # one activation forward and one gradient backward per microbatch
        out["pp"] = 2 * m * act / t
    return out
