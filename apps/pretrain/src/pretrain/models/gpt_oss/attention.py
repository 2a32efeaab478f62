"""gpt-oss attention split over TP and CP: biased q/k/v/o projections, YaRN RoPE, a sink per head,
and every other layer a sliding window (layer 0 first, as transformers' ``layer_types``).

Tensor parallelism splits the query and KV heads (their biases and sinks with them; ``o_proj``'s bias is a
copy added after the reduction). Context parallelism, by ``[parallel].cp_comm_type``:

* ``a2a`` (Ulysses): an all-to-all trades the sequence split for a head split; each rank attends over the
  whole sequence for its heads (and their sinks), then the reverse all-to-all;
* ``p2p`` (ring) and ``allgather``: the keys and values of every rank reach each one (passed around
  the ring, or gathered), and its queries attend to them at their global positions.

Either way the window and the sinks are applied to global positions, so every layout computes the
single rank's attention.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from par_cp import position_ids
from par_cp.ulysses import HeadsToSeq, heads_scatter
from par_groups import comm
from par_groups.autograd import all_gather_along_dim0
from par_groups.param_placement import declare_
from par_tp import ColumnParallelLinear, RowParallelLinear, enter_tensor_parallel_region

from ...blocks.context import ChunkContext, context_attention
from ...blocks.recompute import checkpointed
from ...blocks.rope import apply_rope, rope_for, set_shard_rope_tables_
from .kernel import sink_attention

SLIDING_WINDOW = 128  # keys a sliding layer's query sees, itself included


def window_of(index: int) -> int:
    """Layer ``index``'s window: 0 (full causal) for odd layers, SLIDING_WINDOW for even ones."""
    return SLIDING_WINDOW if index % 2 == 0 else 0


class _RingPass(torch.autograd.Function):
    """Send ``x`` to the next rank of ``group``, receive the previous rank's; backward the reverse."""

    @staticmethod
    def forward(ctx, x, group, step: int):
        ctx.group, ctx.step = group, step
        return _shift(x, group, step)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.group, -ctx.step), None, None


def _shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    x, out = x.contiguous(), torch.empty_like(x)
    to, frm = dist.get_global_rank(group, (rank + step) % size), dist.get_global_rank(group, (rank - step) % size)
    for work in comm.batch_isend_irecv([dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, frm, group)]):
        work.wait()
    return out


class SinkWindowCore(nn.Module):
    """RoPE at this CP shard's positions, then attention with the layer's window and this rank's sinks."""

    def __init__(self, config, context: ChunkContext, index: int) -> None:
        super().__init__()
        self.config, self.window = config, window_of(index)
        self.attn = context_attention(context)  # par-cp's: its CP group, mode, layout and kernel choice
        self.seq_len = context.seq_len
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.register_buffer("positions", None, persistent=False)
        self.init_buffers_(torch.get_default_device())

    def init_buffers_(self, device: torch.device) -> None:
        set_shard_rope_tables_(self, device, self.seq_len, self.config.head_dim)
        rank, size = self.attn.cp_rank_and_size
        self.positions = torch.stack([position_ids(self.seq_len, r, size, self.attn.layout) for r in range(size)]).to(
            device) if torch.device(device).type != "meta" else torch.empty(size, self.seq_len // size, device=device,
                                                                            dtype=torch.long)

    def forward(self, q, k, v, sinks, docs=None):
        if docs is not None and docs.cu_seqlens is not None:
            raise ValueError("gpt-oss attention does not mask packed documents ([data].document_mask)")
        cos, sin = rope_for(self, docs, q.dtype, self.config.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale, backend = 1.0 / math.sqrt(q.shape[3]), self.attn.backend
        rank, size = self.attn.cp_rank_and_size
        if size == 1:
            pos = self.positions[0]
            return sink_attention(q, k, v, sinks, scale, self.window, pos, pos, backend)
        group, mode = self.attn.cp_group, self.attn.mode
        if mode == "a2a":
            qh, kh, vh = heads_scatter(q, k, v, group)
            order = torch.argsort(self.positions.reshape(-1))
            inverse = torch.argsort(order)
            qh, kh, vh = (t.index_select(0, order) for t in (qh, kh, vh))
            pos = self.positions.reshape(-1)[order]
            mine = sinks.view(size, -1)[rank]  # the heads this rank holds after the all-to-all
            out = sink_attention(qh, kh, vh, mine, scale, self.window, pos, pos, backend)
            return HeadsToSeq.apply(out.index_select(0, inverse), group)
        if mode == "p2p":
            blocks = [(k, v, rank)]
            for step in range(1, size):  # the ring: every step each rank passes on the block it holds
                kb, vb, _ = blocks[-1]
                blocks.append((_RingPass.apply(kb, group, 1), _RingPass.apply(vb, group, 1), (rank - step) % size))
            keys = torch.cat([b[0] for b in blocks])
            values = torch.cat([b[1] for b in blocks])
            k_pos = torch.cat([self.positions[r] for _, _, r in blocks])
        elif mode == "allgather":
            keys, values = all_gather_along_dim0(k, group), all_gather_along_dim0(v, group)
            k_pos = self.positions.reshape(-1)
        else:
            raise ValueError(f"gpt-oss attention runs with cp_comm_type p2p, a2a or allgather, not {mode!r}")
        return sink_attention(q, keys, values, sinks, scale, self.window, self.positions[rank], k_pos, backend)


class GptOssAttention(nn.Module):
    """``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (with biases) and ``sinks``, as transformers names them;
    input and output ``[S, B, H]`` (``[S/tp, B, H]`` with sequence parallelism)."""

    def __init__(self, config, context: ChunkContext, index: int) -> None:
        super().__init__()
        g, sp, d = context.groups, context.sequence_parallel, config.head_dim
        tp, tp_rank = g.size("tp"), g.rank_in("tp")
        self.tp_group, self.sp, self.head_dim = g.tp, sp, d
        self.local_heads, self.local_kv_heads = config.heads // tp, config.kv_heads // tp
        self.q_proj = ColumnParallelLinear(config.hidden, config.heads * d, g.tp, bias=True, sequence_parallel=sp)
        self.k_proj = ColumnParallelLinear(config.hidden, config.kv_heads * d, g.tp, bias=True, sequence_parallel=sp)
        self.v_proj = ColumnParallelLinear(config.hidden, config.kv_heads * d, g.tp, bias=True, sequence_parallel=sp)
        self.o_proj = RowParallelLinear(config.heads * d, config.hidden, g.tp, bias=True, sequence_parallel=sp)
        self.sinks = declare_(nn.Parameter(torch.zeros(self.local_heads)), {0: (tp_rank, tp)})
        self.core = SinkWindowCore(config, context, index)
        # [model].recompute's core_attn: RoPE and the sink attention rerun in the backward (no RNG inside)
        self.selective, self.backend = context.recomputes("core_attn", index), context.backend

    def forward(self, x: torch.Tensor, docs=None) -> torch.Tensor:
        x = enter_tensor_parallel_region(x, self.tp_group, self.sp)  # one entry for q, k and v
        q, k, v = self.q_proj.forward_local(x), self.k_proj.forward_local(x), self.v_proj.forward_local(x)
        s, b = q.shape[0], q.shape[1]
        args = (q.view(s, b, self.local_heads, self.head_dim), k.view(s, b, self.local_kv_heads, self.head_dim),
                v.view(s, b, self.local_kv_heads, self.head_dim), self.sinks, docs)
        if self.selective and torch.is_grad_enabled():
            out = checkpointed(self.core, *args, backend=self.backend, replay=False)
        else:
            out = self.core(*args)
        return self.o_proj(out.reshape(s, b, self.local_heads * self.head_dim))
