"""Closed-form sizes of the whole model: parameter counts and training FLOPs.

Used by `pretrain plan` (no process is started) and by the metrics for MFU. The model is the
Llama-3-style decoder of ``[model]``: per layer attention (q and o: h x h; k and v: h x kv_heads
x head_dim), two RMSNorms, and either a SwiGLU MLP (3 x h x ffn) or a DeepSeek-style MoE block
(router h x E, ``shared_experts`` SwiGLU experts and E routed ones, each 3 x h x moe_ffn).

FLOPs count matmuls only, 2 per multiply-add, forward + backward = 3 x forward, recomputation
excluded (model FLOPs, as MFU wants): 6 x (active matmul params) per token, plus causal attention
scores and values, 6 x seq_len x h per layer per token (half of the full 12 x s x h: causal
attention skips the masked half; with MLA 3 x s x heads x (qk_head_dim + v_head_dim)). Latent
attention (MLA) counts DeepSeek's projections (models/deepseek); the MTP modules are counted apart. The
attention core's FLOPs are the family's (``Family.core_flops_per_token``: a hybrid's linear layers run the
chunked delta rule, linear in seq_len).

The first pipeline stage holds the most micro-batches in flight: 1 without pp, M for GPipe, pp
for 1F1B and zero-bubble, pp + (pp-1)/vpp for interleaved (Korthikanti et al.'s L(1 + (p-1)/(pm))),
pp + 1 for DualPipeV. Activation bytes: :mod:`.activations`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..models import family_of
from .params import by_kind, layer_parts


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # input embedding (vocab x h)
    embedding_row: int  # the h weights of one token's row
    output: int  # output head (0 when tied to the embedding)
    final_norm: int
    attention: int  # per layer: q, k, v, o projections and the two norms
    attention_layers: int  # every main layer's together (a hybrid's linear and full-attention layers differ)
    dense_mlp: int  # per dense layer
    router: int  # per MoE layer
    shared_experts: int  # per MoE layer, all shared experts together
    expert: int  # one routed expert
    num_experts: int
    dense_layers: int
    moe_layers: int
    top_k: int

    @property
    def routed_per_layer(self) -> int:
        return self.expert * self.num_experts

    @property
    def total(self) -> int:
        layers = self.attention_layers + self.dense_mlp * self.dense_layers
        moe = (self.router + self.shared_experts + self.routed_per_layer) * self.moe_layers
        return self.embedding + self.output + self.final_norm + layers + moe

    @property
    def active(self) -> int:
        """Parameters one token uses: top_k of the routed experts and its own row of the input embedding.

        The closest to DeepSeek's published counts: V3 36.63B (published 37B), V2 20.85B (21B),
        V2-Lite 2.45B (2.4B); the whole table counted gives 37.55B, 21.38B and 2.66B. A tied table
        is the output head too, so all of it is used.
        """
        unchosen_experts = self.moe_layers * self.expert * (self.num_experts - self.top_k)
        tied = self.output == 0
        unread_rows = 0 if tied else self.embedding - self.embedding_row
        return self.total - unchosen_experts - unread_rows


def param_counts(m: ModelConfig) -> ParamCounts:
    """The main model's counts (as DeepSeek reports 671B / 37B); the MTP modules are ``mtp_params``.
    Per layer from the full shapes (``sizing.params.layer_parts``) of one dense and one MoE layer."""
    h = m.hidden
    ids = range(m.layers + m.mtp_depth)  # an MTP layer may be the only dense (or MoE) one
    dense_id = next((i for i in ids if not m.is_moe_layer(i)), None)
    moe_id = next((i for i in ids if m.is_moe_layer(i)), None)
    dense = layer_parts(m, dense_id) if dense_id is not None else None
    moe = layer_parts(m, moe_id) if moe_id is not None else None
    attention = (dense or moe)["attention"]
    return ParamCounts(
        embedding=m.vocab_size * h,
        embedding_row=h,
        output=0 if m.tie_embeddings else m.vocab_size * h,
        final_norm=h,
        attention=attention,
        attention_layers=sum(n * layer_parts(m, i)["attention"] for i, n in by_kind(m, range(m.layers))),
        dense_mlp=dense["dense_mlp"] if dense else 0,
        router=moe["router"] if moe else 0,
        shared_experts=moe["shared"] if moe else 0,
        expert=moe["experts"] // m.num_experts if moe else 0,
        num_experts=m.num_experts if m.is_moe else 0,
        dense_layers=m.layers - m.num_moe_layers,
        moe_layers=m.num_moe_layers,
        top_k=m.top_k if m.is_moe else 0,
    )


def mtp_params(m: ModelConfig) -> int:
    """The multi-token-prediction modules: per depth one decoder layer (layer ``layers + k``), eh_proj, 3 norms."""
    c, h = param_counts(m), m.hidden
    total = 0
    for j in range(m.layers, m.layers + m.mtp_depth):
        mlp = c.router + c.shared_experts + c.routed_per_layer if m.is_moe_layer(j) else c.dense_mlp
        total += c.attention + mlp + 2 * h * h + 3 * h
    return total


def matmul_params_per_token(m: ModelConfig) -> int:
    """Weights one token multiplies by in a forward pass (norms and the embedding lookup excluded)."""
    c = param_counts(m)
    attention = c.attention_layers - 2 * m.hidden * m.layers
    moe = c.router + c.shared_experts + c.top_k * c.expert
    return (attention + c.dense_mlp * c.dense_layers + moe * c.moe_layers
            + m.vocab_size * m.hidden)  # the output head, tied or not


def training_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs (forward + backward, no recomputation) per trained token."""
    return 6.0 * matmul_params_per_token(m) + family_of(m).core_flops_per_token(m, seq_len)


def training_flops_per_step(m: ModelConfig, seq_len: int, global_batch: int) -> float:
    return training_flops_per_token(m, seq_len) * seq_len * global_batch
