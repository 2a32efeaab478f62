"""Qwen3-Next's full-attention layer: gated attention with partial RoPE, tensor and context parallel.

``q_proj`` gives each head its query and an output gate (``[query | gate]`` per head, 2 x head_dim rows);
queries and keys are RMS-normalised per head (``q_norm``, ``k_norm``), then RoPE turns the first
``partial_rotary_factor`` of each head's channels (rotate-half within them); the attention's output is
multiplied by ``sigmoid(gate)`` before ``o_proj``. Heads split over tp (``q_proj`` by head rows, ``k_proj`` /
``v_proj`` by KV heads, ``o_proj`` row-parallel; the norms are copies with partial grads); the core is
par-cp's attention (``blocks.context.context_attention``), packed documents as for every family.
"""

from __future__ import annotations

import torch
from torch import nn

from par_groups import declare_copies_
from par_tp import ColumnParallelLinear, RowParallelLinear, enter_tensor_parallel_region

from ...blocks.context import context_attention
from ...blocks.recompute import checkpointed
from ...blocks.rope import apply_rope, rope_for, set_shard_rope_tables_


def rotary_dim(m) -> int:
    return int(m.head_dim * m.partial_rotary_factor)


class TPGatedAttention(nn.Module):
    def __init__(self, config, context, index: int = 0) -> None:
        super().__init__()
        g, d = context.groups, config.head_dim
        self.config, self.tp_group, self.sp, self.seq_len = config, g.tp, context.sequence_parallel, context.seq_len
        tp = g.size("tp")
        self.heads, self.kv_heads = config.heads // tp, config.kv_heads // tp
        self.q_proj = ColumnParallelLinear(config.hidden, 2 * config.heads * d, g.tp)
        self.k_proj = ColumnParallelLinear(config.hidden, config.kv_heads * d, g.tp)
        self.v_proj = ColumnParallelLinear(config.hidden, config.kv_heads * d, g.tp)
        self.o_proj = RowParallelLinear(config.heads * d, config.hidden, g.tp, input_is_parallel=True,
                                        sequence_parallel=self.sp)
        self.q_norm, self.k_norm = (declare_copies_(nn.RMSNorm(d, eps=config.norm_eps), g.tp, True) for _ in range(2))
        self.attn = context_attention(context)
        # [model].recompute's core_attn: the q / k norms, RoPE and the attention rerun in the backward
        self.selective, self.backend = context.recomputes("core_attn", index), context.backend
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.init_buffers_(torch.get_default_device())

    def init_buffers_(self, device: torch.device) -> None:
        set_shard_rope_tables_(self, device, self.seq_len, rotary_dim(self.config))

    def _core(self, q, k, v, docs):
        rot = rotary_dim(self.config)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_for(self, docs, q.dtype, rot)
        q = torch.cat([apply_rope(q[..., :rot], cos, sin), q[..., rot:]], -1)
        k = torch.cat([apply_rope(k[..., :rot], cos, sin), k[..., rot:]], -1)
        return self.attn(q, k, v, None if docs is None else docs.cu_seqlens)

    def forward(self, x: torch.Tensor, docs=None) -> torch.Tensor:
        d = self.config.head_dim
        x = enter_tensor_parallel_region(x, self.tp_group, self.sp)
        s, b = x.shape[:2]
        q, gate = self.q_proj.forward_local(x).view(s, b, self.heads, 2 * d).split([d, d], dim=-1)
        k = self.k_proj.forward_local(x).view(s, b, self.kv_heads, d)
        v = self.v_proj.forward_local(x).view(s, b, self.kv_heads, d)
        if self.selective and torch.is_grad_enabled():
            out = checkpointed(self._core, q, k, v, docs, backend=self.backend, replay=False)
        else:
            out = self._core(q, k, v, docs)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(s, b, -1))
