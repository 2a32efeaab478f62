"""GQA's attention core, injected into ``par_tp.TPAttention``: RoPE, then context-parallel attention."""

from __future__ import annotations

import math

import torch
from torch import nn

from par_groups import declare_copies_

from ...data.packing import Documents
from ...blocks.dropout import attention_with_dropout
from ...blocks.context import ChunkContext, context_attention
from ...blocks.qk_clip import HeadLogitMax
from ...blocks.rope import apply_rope, rope_for, set_shard_rope_tables_
from ...blocks.recompute import checkpointed
from ...training.dynamic_cp import DynamicDocuments


class RopeThenContextAttention(nn.Module):
    """The attention core injected into TPAttention: RoPE at this CP shard's positions, then CP attention.
    ``docs`` (packed documents) restarts the positions and keeps attention inside each document.
    With ``qk_norm`` (Qwen3) each head's query and key first go through its RMSNorm: copies on every
    TP rank, each seeing only its own heads, so their grads are partial sums over TP."""

    def __init__(self, config, context: ChunkContext, layer: int = 0) -> None:
        super().__init__()
        self.config, self.layer = config, layer  # the layer index: attention dropout's masks differ per layer
        if config.qk_norm:
            self.q_norm, self.k_norm = (declare_copies_(nn.RMSNorm(config.head_dim, eps=config.norm_eps), context.groups.tp, True)
                                        for _ in range(2))
        self.attn = context_attention(context)
        self.seq_len, self.dropout_at = context.seq_len, context.dropout
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.init_buffers_(torch.get_default_device())
        self.selective, self.backend = context.recomputes("core_attn", layer), context.backend
        self.logit_max = HeadLogitMax(self.attn, context.seq_len) if context.qk_clip else None

    def init_buffers_(self, device: torch.device) -> None:
        set_shard_rope_tables_(self, device, self.seq_len, self.config.head_dim)

    def _core(self, q, k, v, docs, where=None):
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_for(self, docs, q.dtype, self.config.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.logit_max is not None and self.training:  # the step's batch only (not eval's)
            self.logit_max.observe(q, k, docs)
        if isinstance(docs, DynamicDocuments):  # dynamic CP: each document on its own block of ranks
            scale = self.attn.softmax_scale if self.attn.softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
            return docs.attend(q, k, v, scale, self.attn.backend)
        if where is not None:  # [model].attention_dropout (config/checks.py: one rank's whole sequence, no documents)
            scale = self.attn.softmax_scale if self.attn.softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
            return attention_with_dropout(q, k, v, scale, self.config.attention_dropout, where, self.layer)
        return self.attn(q, k, v, None if docs is None else docs.cu_seqlens)

    def forward(self, q, k, v, docs: Documents | None = None):
        # [model].attention_dropout: the micro-batch's place, taken now so that a recomputation draws the same mask
        where = self.dropout_at.at if self.config.attention_dropout > 0 and self.training else None
        if self.selective and torch.is_grad_enabled():  # recompute attention only: its activations dominate
            # the dropout place is the argument `where`: nothing to replay but torch's RNG
            return checkpointed(self._core, q, k, v, docs, where, backend=self.backend, replay=False)
        return self._core(q, k, v, docs, where)
