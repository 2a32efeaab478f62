"""The narrowed copy of the user's model that certify trains, and the one-rank reference's config.

Narrowing keeps the model's kinds of layers and the layout exactly; it makes widths small so the
reference fits on one device: per head 8 channels (the attention family narrows its own widths),
FFN widths 2x hidden (MoE experts' 1x), 64 tokens per sequence (kept divisible by 2 x cp x tp),
and only as many layers as the layout needs (every pipeline chunk keeps at least one, a hybrid keeps
one whole repeat of its layer kinds, uneven stages keep their counts, MoE layers start where they
started, MTP stays). What it keeps: the vocabulary and its padding, heads and KV heads (the TP
split), experts, top-k and groups, the family, MTP, tied embeddings, RoPE scaling, packed documents,
the dispatcher, every [parallel] key. Each narrowing is applied only if the config stays valid for
the world; ``--set`` goes after them, so the user narrows further (or undoes one).
"""

from __future__ import annotations

from ..config import load_config
from ..errors import UsageError
from ..models import family_of

HEAD_DIM = 8
SEQ_LEN = 64
# Certify's own settings: fp32, no evaluation, no progress bar, no periodic checkpoints.
RUN = ("train.dtype=fp32", "train.eval_every=0", "log.progress=false", "checkpoint.every=0", "train.compile=false")


def _candidates(cfg, world: int) -> list[str]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out = []
    hidden = m.heads * HEAD_DIM
    if m.hidden > hidden:
        out.append(f"model.hidden={hidden}")
    width = min(m.hidden, hidden)
    if m.ffn_hidden > 2 * width:
        out.append(f"model.ffn_hidden={2 * width}")
    if m.num_experts and (m.moe_ffn_hidden or m.ffn_hidden) > width:
        out.append(f"model.moe_ffn_hidden={width}")
    out += family_of(m).narrowing(m, HEAD_DIM)  # the attention's own widths (pretrain.models)
    step = 2 * p.cp * p.tp
    seq = max(step, SEQ_LEN // step * step)
    if t.seq_len > seq:
        out.append(f"train.seq_len={seq}")
    if not (p.first_stage_layers or p.last_stage_layers):
        chunks = p.pp * p.chunks_per_rank
        needed = max(chunks, m.moe_layers_start + 1 if m.num_experts else 1, 2, family_of(m).layer_period(m))
        needed = -(-needed // chunks) * chunks
        if m.layers > needed and not m.mlp_only_layers and m.decoder_sparse_step == 1:
            out.append(f"model.layers={needed}")
    return out


def narrowed_overrides(config: str | None, overrides: list[str], world: int) -> list[str]:
    """The overrides that narrow the user's config for ``world`` ranks: certify's own settings, then
    each narrowing that keeps the config valid, then the user's ``--set`` (applied last)."""
    cfg = load_config(config, list(overrides))
    cfg.validate_world(world)  # the user's layout must fit first: its error is the one to show
    kept = list(RUN)
    for item in _candidates(cfg, world):
        try:
            load_config(config, kept + [item] + list(overrides)).validate_world(world)
        except (UsageError, ValueError):
            continue
        kept.append(item)
    return kept + list(overrides)


def reference_overrides(cfg, layout) -> list[str]:
    """The same model on one rank: every parallel degree 1, no sharding, the same data, and the
    layout's global micro-batch (its micro-batch on every dp rank together: MoE balancing losses are
    per global micro-batch), so as many micro-batches as the layout. With dp > 1 and several
    micro-batches the reference's micro-batch m holds other sequences than the layout's global
    micro-batch m (the sampler gives each dp rank a contiguous block): dense models do not mind,
    MoE balancing losses would, see :func:`check_certifiable`."""
    return ["parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.cp=1", "parallel.cp_comm_type=p2p",
            "parallel.hcp=[]", "parallel.ep=1", "parallel.etp=0", "parallel.zero=no_shard", "parallel.hsdp_replicas=1",
            "parallel.schedule=1f1b", "parallel.microbatches=0", "parallel.first_stage_layers=0",
            "parallel.last_stage_layers=0", "parallel.tp_comm_overlap=false", "parallel.rank_assignment=off",
            f"train.micro_batch={_reference_micro_batch(cfg, layout)}"]


def _reference_micro_batch(cfg, layout) -> int:
    """The layout's global micro-batch, or with par's FP8 its per-dp-rank one: FP8 scales are taken per
    micro-batch on each dp rank (never over dp), so one rank quantizes the same tensors only with the
    dp ranks' micro-batches as its own."""
    from ..config.train_section import PAR_FP8

    return layout.micro_batch if cfg.train.fp8 in PAR_FP8 else layout.micro_batch * layout.dp


def check_certifiable(cfg, layout) -> None:
    """What certify cannot compare yet: one line, exit 2."""
    m = cfg.model
    balancing = m.aux_loss_coeff or m.seq_aux_loss_coeff or m.z_loss_coeff
    if m.num_experts and balancing and layout.dp > 1 and layout.microbatches > 1:
        raise UsageError(f"certify compares MoE balancing losses per global micro-batch: with dp={layout.dp} use one "
                         f"micro-batch per step (--set train.micro_batch={cfg.train.global_batch // layout.dp}), "
                         f"not {layout.microbatches}")
    if m.num_experts and balancing and layout.dp > 1 and cfg.train.fp8 not in ("off", "delayed", "current"):
        raise UsageError(f"certify compares MoE balancing losses per global micro-batch, and par's FP8 "
                         f"([train].fp8={cfg.train.fp8!r}) per dp rank's: with dp={layout.dp} certify one of them")
    if cfg.parallel.dynamic_cp:
        raise UsageError("certify does not support [parallel].dynamic_cp (its micro-batches are not the reference's)")
