"""Parameter elements: per decoder layer and part, and what one rank holds of its pipeline stage.

Counted from the full shapes (``pretrain.model.shapes``), the one account of the model's tensors:
attention heads (as the family declares) and the dense MLP split over tp; routers, shared experts and
the attention's other tensors copied over tp; the routed experts over ep and expert tp; the embedding and
head with the padded vocabulary (``ModelConfig.padded_vocab``); the MTP layers on the last stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..model.muon_split import uses_muon
from ..models import family_of
from ..model.shapes import layer_shapes



@dataclass(frozen=True)
class RankParams:
    dense: int  # elements of this rank's non-expert parameters (TP shards; norms and routers whole)
    experts: int  # elements of its routed-expert parameters
    muon_dense: int = 0  # of ``dense``, the hidden matrices ``[train].optimizer = "muon"`` steps with Muon
    # (model/muon_split.py; every routed expert's matrix is Muon's too)


def rank_params(cfg, layout, stage: int) -> RankParams:
    """Parameter elements pipeline stage ``stage`` holds on one tp (x ep) rank."""
    m, tp, h = cfg.model, layout.tp, cfg.model.hidden
    chunks = chunks_of(cfg, layout, stage)
    has_first, has_last = 0 in chunks, _num_chunks(layout) - 1 in chunks
    mtp = range(m.layers, m.layers + m.mtp_depth) if has_last else range(0)  # multi-token prediction layers
    dense = len(mtp) * (2 * h * h + 3 * h)  # each MTP layer's eh_proj and 3 norms (copies over tp)
    muon = len(mtp) * 2 * h * h  # eh_proj
    experts = 0
    for i, count in by_kind(m, [*stage_layers(cfg.parallel, m.layers)[stage], *mtp]):
        d, e, mu = _layer_params(m, layout, i)
        dense, experts, muon = dense + count * d, experts + count * e, muon + count * mu
    # the input embedding; the head (tied: the embedding itself, or its copy on the last stage);
    # MTP's embedding copy on the last stage (tied: the head is that copy)
    mtp_copy = has_last and m.mtp_depth > 0 and not has_first and not m.tie_embeddings
    embeddings = int(has_first) + int(has_last and not (m.tie_embeddings and has_first)) + int(mtp_copy)
    dense += embeddings * m.padded_vocab(tp) * h // tp + (h if has_last else 0)  # + the final norm
    return RankParams(dense, experts, muon)


@lru_cache(maxsize=4096)
def stage_layers(parallel, layers: int) -> tuple[tuple[int, ...], ...]:
    """``parallel.stage_layers(layers)``, computed once per [parallel] (the search asks thousands of times)."""
    return tuple(tuple(ids) for ids in parallel.stage_layers(layers))


@lru_cache(maxsize=4096)
def chunk_layers(parallel, layers: int) -> tuple[range, ...]:
    """``parallel.chunk_layers(layers)``, computed once per [parallel]."""
    return tuple(parallel.chunk_layers(layers))


def by_kind(m, layers) -> list[tuple[int, int]]:
    """(a layer, how many) of each kind among ``layers`` (dense or MoE, and the family's kind of attention:
    a hybrid's linear and full-attention layers): layers of a kind are sized alike."""
    return _by_kind(m, tuple(layers))


@lru_cache(maxsize=4096)
def _by_kind(m, layers: tuple[int, ...]) -> list[tuple[int, int]]:
    kinds: dict[tuple[bool, int], list[int]] = {}
    family = family_of(m)
    for i in layers:
        kinds.setdefault((m.is_moe_layer(i), family.layer_kind(m, i)), [i, 0])[1] += 1
    return [(i, n) for i, n in kinds.values()]


def _layer_params(m, layout, i: int) -> tuple[int, int, int]:
    """(dense, routed-expert, Muon's dense) elements of decoder layer ``i`` on one rank, from its full shapes."""
    dense = experts = muon = 0
    for name, shape in layer_shapes(m, i).items():
        part, n = layer_part(name), _on_rank(m, layout, name, math.prod(shape))
        if part == "experts":
            experts += n
        elif part != "buffer":
            dense += n
            muon += n if uses_muon(name, shape) else 0
    return dense, experts, muon


# The dense MLP's weights split over tp as the trainer builds them (column- and row-parallel); the
# attention's split tensors are its family's (``Family.tp_split``).
MLP_TP_SPLIT = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _on_rank(m, layout, name: str, elements: int) -> int:
    """A tensor's elements on one rank: TP splits heads (the family's ``tp_split``) and the dense MLP,
    KV heads (``kv_split``) when tp divides them (else each rank holds the one KV head its query heads
    use); the routed experts are split over ep and expert tp; routers, shared experts, norms and the
    rest of the attention are copies."""
    tp, leaf, family = layout.tp, ".".join(name.split(".")[-2:]), family_of(m)
    if leaf in MLP_TP_SPLIT or leaf in family.tp_split:
        return elements // tp
    if leaf in family.kv_split:
        return elements // tp if m.kv_heads % tp == 0 else elements // m.kv_heads
    if layer_part(name) == "experts":
        return elements // m.num_experts * (m.num_experts // layout.ep) // layout.etp
    return elements


def layer_part(name: str) -> str:
    """Which part of a decoder layer a tensor (HF name) is: attention (with the layer's two norms),
    dense_mlp, router, shared (experts), experts (routed) or buffer (the router's bias, not trained)."""
    if ".mlp." not in name:
        return "attention"
    tail = name.split(".mlp.", 1)[1]
    for prefix, part in (("experts.", "experts"), ("shared.", "shared"), ("router.weight", "router"),
                         ("router.expert_bias", "buffer")):
        if tail.startswith(prefix):
            return part
    return "dense_mlp"


def layer_parts(m, i: int) -> dict[str, int]:
    """Elements of decoder layer ``i``'s full tensors by :func:`layer_part`."""
    parts = dict.fromkeys(("attention", "dense_mlp", "router", "shared", "experts", "buffer"), 0)
    for name, shape in layer_shapes(m, i).items():
        parts[layer_part(name)] += math.prod(shape)
    return parts


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
