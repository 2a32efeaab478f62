"""``[model].expert_balance = "replicate"``: the bytes the replicas move and hold (par_moe.balance, .replicate).

Per MoE layer and micro-batch, a home rank sends each replica of one of its experts that expert's
weights, w_gate and w_up ``[F/etp, H]`` and w_down ``[H, F/etp]`` (its expert-TP shard): 3 H F / etp
elements in the parameters' dtype, in one all-to-all; the backward returns each replica's gradient,
the same bytes. How many replicas a micro-batch makes follows the routing (the plan's
``fetched(rank)``: sent, ``replicas[rank]``: received); a rank receives at most
``max_replicas_per_rank`` per MoE layer, so that bounds its buffers.

Held: the fetched weights are saved for the experts' backward, so each MoE layer keeps them per
micro-batch in flight (counted in the chunk's saved set, :mod:`.activations`); its backward makes
their gradients (as many bytes) before the return sends them home.
"""

from __future__ import annotations

from par_moe.balance import plan_replicas

from ..model.replace import group_domains
from ..runtime.rank_assignment import choose_assignment, described_topology
from .params import chunks_of


def expert_elements(model, etp: int) -> int:
    """Elements of one routed expert's weights on one expert-TP rank."""
    return 3 * model.hidden * model.expert_ffn_hidden // etp


def replica_bytes(model, etp: int, replicas: int, param_bytes: int) -> int:
    """Bytes of the weight fetch of ``replicas`` replicas (and of their gradients' return): one direction."""
    return replicas * expert_elements(model, etp) * param_bytes


def held_replicas(cfg, layout, pairs: list[int] | None = None, ep_rank: int = 0) -> int:
    """Replica weight sets one MoE layer of EP rank ``ep_rank`` fetches per micro-batch: under a declared
    routing (``pairs``: each rank's pairs per expert) its plan's, else the most it may (0: none balanced)."""
    if cfg.model.expert_balance == "none" or layout.ep == 1:  # replicate, replicate+replace
        return 0
    if pairs is None:
        return cfg.model.max_replicas_per_rank
    return len(declared_plan(cfg, layout, pairs).replicas[ep_rank])


def stage_moe_layers(cfg, layout, stage: int) -> int:
    """MoE layers on pipeline ``stage`` (the last one's MTP layers too)."""
    m = cfg.model
    layers = [*cfg.parallel.stage_layers(m.layers)[stage]]
    if layout.pp * layout.chunks_per_rank - 1 in chunks_of(cfg, layout, stage):
        layers += range(m.layers, m.layers + m.mtp_depth)
    return sum(m.is_moe_layer(i) for i in layers)


def declared_plan(cfg, layout, pairs: list[int]):
    """The replica plan of one MoE layer and micro-batch when every EP rank routes ``pairs`` per expert
    (a declared routing: ``sizing.activations.routed_sizes(...).pairs``), in the described cluster's
    NVLink domains (:func:`declared_domains`)."""
    m = cfg.model
    return plan_replicas([pairs] * layout.ep, m.num_experts // layout.ep, m.max_replicas_per_rank,
                         declared_domains(cfg, layout), m.replicate_across_domains)


def declared_domains(cfg, layout) -> tuple[int, ...] | None:
    """The EP ranks' NVLink domains on the cluster ``[topology]`` describes, placed as a run places its
    ranks there (``runtime.rank_assignment``), as a run finds them (``model.replace.ep_domains``): the
    pattern every EP group shares; None without a described topology, or where the groups differ."""
    if cfg.model.expert_balance == "none" or layout.ep == 1:
        return None
    topology = described_topology(cfg, layout.world_size)
    if topology is None:
        return None
    chosen = choose_assignment(cfg, layout, topology)
    place = chosen.permutation or range(layout.world_size)
    patterns = {group_domains(topology, [place[i] for i in group]) for group in chosen.grid.expert_ranks("ep")}
    return patterns.pop() if len(patterns) == 1 else None


def replica_figures(cfg, layout, moe_layers: int, param_bytes: int, pairs: list[int] | None = None,
                    ep_rank: int = 0) -> dict:
    """The replicas of one rank (``moe_layers`` MoE layers on its stage) over one step, for ``plan``:
    at most; under a declared routing (``pairs``, see :func:`declared_plan`: ``plan --simulate``) also
    what its plan makes."""
    m, etp, steps = cfg.model, layout.etp, moe_layers * layout.microbatches
    most = held_replicas(cfg, layout)
    one = replica_bytes(m, etp, 1, param_bytes)
    out = {"max_replicas_per_rank": most, "bytes_per_replica": one, "moe_layers": moe_layers,
           "microbatches": layout.microbatches,
           "held_per_microbatch": moe_layers * most * one,  # weights saved for backward, each layer
           "gradient_buffer": most * one,  # one layer's replica gradients, before the return
           "fetch_bytes_per_step_max": steps * most * one, "return_bytes_per_step_max": steps * most * one}
    if pairs is not None:
        plan = declared_plan(cfg, layout, pairs)
        out |= {"replicas_per_layer": sum(len(r) for r in plan.replicas),
                "fetch_sent_per_step": steps * replica_bytes(m, etp, plan.fetched(ep_rank), param_bytes),
                "fetch_received_per_step": steps * replica_bytes(m, etp, len(plan.replicas[ep_rank]), param_bytes),
                "slots_max_over_mean_before": plan.max_over_mean(plan.load_before),
                "slots_max_over_mean_after": plan.max_over_mean(plan.load_after)}
    return out
