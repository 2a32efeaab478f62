"""What one rank should hold and send, in closed form, for the layout it plays in a world.

The figures model exactly what the trainer keeps (Megatron-style mixed precision on GPUs): bf16
parameters (fp32 on the CPU), gradients accumulated and reduced in ``[train].grad_reduce_dtype``,
and the fp32 main weights (bf16 runs only) plus two fp32 Adam moments in the optimizer, sharded
as ``[parallel].zero`` says. Activations are what the trainer's layers save for this rank's
stage (see :func:`layer_bytes_per_token`): its own layer count and the micro-batches its
schedule keeps in flight.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..flops import microbatches_in_flight

SHARD_GRADS = ("optim_grads", "optim_grads_params")


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
    for i in [*cfg.parallel.stage_layers(m.layers)[stage], *mtp]:
        d, e = _layer_params(m, layout, i)
        dense, experts = dense + d, experts + e
    embeddings = int(has_first) + int(has_last and m.mtp_depth > 0 and not has_first)  # MTP's copy on the last stage
    dense += embeddings * m.vocab_size * h // tp
    if has_last:
        dense += h + (0 if m.tie_embeddings and has_first else m.vocab_size * h // tp)
    return RankParams(dense, experts)


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
    if layout.pp == 1:
        return [0]
    from par_pp import chunks_on_rank

    return chunks_on_rank(cfg.parallel.schedule, stage, layout.pp, layout.vpp)


def dtypes(cfg, device_type: str = "cuda") -> tuple[int, int, bool]:
    """(param bytes, grad bytes, keeps an fp32 main copy) of the trainer's mixed precision."""
    bf16 = cfg.train.resolved_dtype(device_type) == "bf16"
    grad = 2 if bf16 and cfg.train.grad_reduce_dtype == "bf16" else 4
    return (2 if bf16 else 4), grad, bf16


def planned_state(cfg, layout, stage: int, device_type: str = "cuda") -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state this rank keeps through a step."""
    zero, p = cfg.parallel.zero, rank_params(cfg, layout, stage)
    pb, gb, main = dtypes(cfg, device_type)
    d, ed = layout.dp * layout.cp, layout.edp
    opt = 8 + (4 if main else 0)
    params = grads = optim = 0.0
    for n, k in ((p.dense, d), (p.experts, ed)):
        shard = n / k
        params += pb * (shard if zero == "optim_grads_params" else n)
        grads += gb * (shard if zero in SHARD_GRADS else n)
        optim += opt * (n if zero == "no_shard" else shard)
    return {"params": params, "grads": grads, "optim": optim}


def layer_bytes_per_token(cfg, layout) -> float:
    """Bytes one dense decoder layer keeps for backward, per token of the micro-batch, as the
    trainer's layers save them (bf16 compute, RMSNorm in fp32, SwiGLU, SDPA attention):

    * each RMSNorm: its input upcast to fp32 and the fp32 normalized value (8 h per token it sees);
    * attention: the TP region's gathered input (h), q, k, v for the recomputed core (selective)
      and the core's output (q width), all TP-local widths;
    * MLP: the gathered input (h), gate, silu(gate), up and their product (4 ffn/tp).

    Full recomputation keeps the layer input only; no recomputation also keeps RoPE'd q and k.
    """
    m, tp = cfg.model, layout.tp
    pb = 2 if cfg.train.resolved_dtype("cuda") == "bf16" else 4
    h, d = m.hidden, m.head_dim
    norm_share = tp if layout.sequence_parallel else 1
    if m.recompute == "full":
        return h / norm_share * pb
    q = m.heads * d / tp
    kv = (m.kv_heads // tp if m.kv_heads % tp == 0 else 1) * d
    norms = 2 * 8 * h / norm_share
    attention = (h + 2 * q + 2 * kv) * pb + ((q + kv) * pb if m.recompute == "none" else 0)
    mlp = (h + 4 * m.ffn_hidden / tp) * pb
    return norms + attention + mlp


def in_flight(cfg, layout, stage: int) -> float:
    """Micro-batches whose activations pipeline ``stage`` holds at its peak."""
    p = cfg.parallel
    if layout.pp == 1:
        return 1.0
    if p.schedule in ("1f1b", "zb-h1"):  # stage s warms up with pp - s forwards
        return float(min(layout.pp - stage, layout.microbatches))
    return microbatches_in_flight(p.schedule, layout.pp, layout.vpp, layout.microbatches)


def planned_activations(cfg, layout, stage: int) -> float:
    """Activation bytes at this stage's peak: its layers x micro-batches in flight; the last stage
    adds the logits (bf16 from the head and the loss's one fp32 buffer, ``[S, mb, V/tp]`` each).
    MoE layers are not modelled here yet."""
    m, t = cfg.model, cfg.train
    pb = 2 if t.resolved_dtype("cuda") == "bf16" else 4
    tokens = t.seq_len / layout.cp * layout.micro_batch
    layers = len(cfg.parallel.stage_layers(m.layers)[stage])
    received = [c for c in chunks_of(cfg, layout, stage) if c > 0]  # inputs kept for the chunk's backward
    norm_share = layout.tp if layout.sequence_parallel else 1
    per_mb = (layers * layer_bytes_per_token(cfg, layout) + len(received) * m.hidden / norm_share * pb) * tokens
    if m.recompute == "full":  # one layer's activations exist while it is recomputed
        full = dataclasses.replace(cfg, model=dataclasses.replace(m, recompute="selective"))
        per_mb_extra = layer_bytes_per_token(full, layout) * tokens
    else:
        per_mb_extra = 0.0
    last = layout.pp * layout.chunks_per_rank - 1 in chunks_of(cfg, layout, stage)
    logits = tokens * m.vocab_size / layout.tp * (4 + pb) if last else 0.0
    return per_mb * in_flight(cfg, layout, stage) + per_mb_extra + logits
