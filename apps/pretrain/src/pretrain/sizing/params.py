"""Parameter elements one rank holds: its pipeline stage's chunks, cut by tp, ep and expert tp.

Counted from the shapes the trainer builds: attention heads and the dense MLP split over tp;
routers, shared experts and MLA's down-projections copied over tp; the embedding and head with
the padded vocabulary (``ModelConfig.padded_vocab``); the MTP layers on the last stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache



@dataclass(frozen=True)
class RankParams:
    dense: int  # elements of this rank's non-expert parameters (TP shards; norms and routers whole)
    experts: int  # elements of its routed-expert parameters


def rank_params(cfg, layout, stage: int) -> RankParams:
    """Parameter elements pipeline stage ``stage`` holds on one tp (x ep) rank."""
    m, tp, h = cfg.model, layout.tp, cfg.model.hidden
    chunks = chunks_of(cfg, layout, stage)
    has_first, has_last = 0 in chunks, _num_chunks(layout) - 1 in chunks
    mtp = range(m.layers, m.layers + m.mtp_depth) if has_last else range(0)  # multi-token prediction layers
    dense = len(mtp) * (2 * h * h + 3 * h)  # each MTP layer's eh_proj and 3 norms (copies over tp)
    experts = 0
    for i, count in by_kind(m, [*stage_layers(cfg.parallel, m.layers)[stage], *mtp]):
        d, e = _layer_params(m, layout, i)
        dense, experts = dense + count * d, experts + count * e
    # the input embedding; the head (tied: the embedding itself, or its copy on the last stage);
    # MTP's embedding copy on the last stage (tied: the head is that copy)
    mtp_copy = has_last and m.mtp_depth > 0 and not has_first and not m.tie_embeddings
    embeddings = int(has_first) + int(has_last and not (m.tie_embeddings and has_first)) + int(mtp_copy)
    dense += embeddings * m.padded_vocab(tp) * h // tp + (h if has_last else 0)  # + the final norm
    return RankParams(dense, experts)


@lru_cache(maxsize=4096)
def stage_layers(parallel, layers: int) -> tuple[tuple[int, ...], ...]:
    """``parallel.stage_layers(layers)``, computed once per [parallel] (the search asks thousands of times)."""
    return tuple(tuple(ids) for ids in parallel.stage_layers(layers))


@lru_cache(maxsize=4096)
def chunk_layers(parallel, layers: int) -> tuple[range, ...]:
    """``parallel.chunk_layers(layers)``, computed once per [parallel]."""
    return tuple(parallel.chunk_layers(layers))


def by_kind(m, layers) -> list[tuple[int, int]]:
    """(a layer, how many) of each kind among ``layers`` (dense, MoE): layers of a kind are sized alike."""
    return _by_kind(m, tuple(layers))


@lru_cache(maxsize=4096)
def _by_kind(m, layers: tuple[int, ...]) -> list[tuple[int, int]]:
    kinds: dict[bool, list[int]] = {}
    for i in layers:
        kinds.setdefault(m.is_moe_layer(i), [i, 0])[1] += 1
    return [(i, n) for i, n in kinds.values()]


def _layer_params(m, layout, i: int) -> tuple[int, int]:
    """(dense, routed-expert) elements of decoder layer ``i`` on one rank: TP splits attention heads
    and the dense MLP; routers, shared experts and MLA's down-projections are copies over tp."""
    tp, h = layout.tp, m.hidden
    if m.attention == "mla":
        from ..model.mla import mla_shapes

        split = ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")
        dense = sum(math.prod(s) // (tp if n in split else 1) for n, s in mla_shapes(m, "").items())
    else:
        kv = (m.kv_heads // tp if m.kv_heads % tp == 0 else 1) * m.head_dim
        dense = 2 * h * (m.heads * m.head_dim) // tp + 2 * h * kv
    dense += 2 * h  # the two norms
    if not m.is_moe_layer(i):
        return dense + 3 * h * m.ffn_hidden // tp, 0
    f = m.expert_ffn_hidden
    dense += h * m.num_experts + 3 * h * f * m.shared_experts
    return dense, (m.num_experts // layout.ep) * 3 * h * f // layout.etp


def _num_chunks(layout) -> int:
    return layout.pp * layout.chunks_per_rank


def chunks_of(cfg, layout, stage: int) -> list[int]:
    return _chunks(cfg.parallel.schedule, stage, layout.pp, layout.vpp)


@lru_cache(maxsize=4096)
def _chunks(schedule: str, stage: int, pp: int, vpp: int) -> list[int]:
    if pp == 1:
        return [0]
    from par_pp import chunks_on_rank

    return chunks_on_rank(schedule, stage, pp, vpp)
