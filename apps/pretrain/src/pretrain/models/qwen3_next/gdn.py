"""Gated DeltaNet (Qwen3-Next's linear-attention layer), tensor and context parallel.

Per token: ``in_proj_qkvz`` gives, for each key head, its query and key (``linear_key_dim``) and the
value and output gate ``z`` of its ``linear_value_heads / linear_key_heads`` value heads
(``linear_value_dim``); ``in_proj_ba`` gives each value head's write strength ``beta = sigmoid(b)``
and decay input ``a``. Queries, keys and values go through a short causal depthwise conv
(``conv_kernel`` taps) and SiLU; queries and keys are L2-normalised (queries then scaled by
``1/sqrt(linear_key_dim)``); the log decay is ``g = -exp(A_log) softplus(a + dt_bias)``. The gated
delta rule (``par_cp.delta_rule``) runs per value head (a key head serves its value heads); its output
is RMS-normalised per head (weight ``norm``), times ``silu(z)``, then ``out_proj``.

Tensor parallel by key heads (and with them their value heads): ``in_proj_qkvz`` / ``in_proj_ba``
are column-parallel (their rows are grouped by key head), the conv channels, ``A_log`` and
``dt_bias`` are split the same way, ``out_proj`` is row-parallel, ``norm`` is a copy (partial grad:
each rank normalises its own heads). The conv weight is kept as three tensors (``conv_q``,
``conv_k``, ``conv_v``: the released ``conv1d.weight``'s query, key and value channels), so each is one
contiguous block per rank. Context parallel, by ``[parallel].cp_comm_type``: p2p and allgather run
``par_cp.state_passing`` (the conv's halo and the state pass); a2a trades the sequence split for a key-head
split (as Megatron runs Gated DeltaNet under CP): one all-to-all gives each rank the whole sequence of
``1/cp`` of the key heads (their projections before the conv, ``beta`` and ``a``), the conv and the rule run
there as on one rank, and a second brings the rule's output back to the sequence split; a2a+p2p does that
all-to-all in the inner groups and the state pass over the outer ring (the inner group's tokens, sorted,
are the outer ring's pieces). Packed documents reset the conv window and the state at each document start.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from par_cp import HeadsToSeq, SeqToHeads, position_ids, shard_segments
from par_cp.state_passing import causal_conv1d, context_parallel_delta_rule
from par_cp.ulysses import gathered_order
from par_groups import declare_, declare_copies_
from par_tp import ColumnParallelLinear, RowParallelLinear, enter_tensor_parallel_region

from ...blocks.recompute import checkpointed


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """flash-linear-attention's (and transformers') L2 normalisation: ``x / sqrt(|x|^2 + 1e-6)``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def qkvz_layout(m) -> tuple[int, int, int]:
    """(key heads, value heads per key head, rows per key head of in_proj_qkvz)."""
    r = m.linear_value_heads // m.linear_key_heads
    return m.linear_key_heads, r, 2 * m.linear_key_dim + 2 * r * m.linear_value_dim


class TPGatedDeltaNet(nn.Module):
    def __init__(self, config, context, index: int = 0) -> None:
        super().__init__()
        g = context.groups
        tp, self.tp_group, self.sp = g.size("tp"), g.tp, context.sequence_parallel
        self.tp_rank = g.rank_in("tp")
        self.config, self.cp_group, self.seq_len = config, g.cp, context.seq_len
        self.cp_mode, self.hcp = context.cp_mode, (g.hcp if context.cp_mode == "a2a+p2p" else ())
        nk, r, rows = qkvz_layout(config)
        self.nk, self.r, dk, dv = nk // tp, r, config.linear_key_dim, config.linear_value_dim
        self.in_proj_qkvz = ColumnParallelLinear(config.hidden, nk * rows, g.tp)
        self.in_proj_ba = ColumnParallelLinear(config.hidden, 2 * nk * r, g.tp)
        split, kernel = {0: (self.tp_rank, tp)}, config.conv_kernel
        self.conv_q = declare_(nn.Parameter(torch.empty(self.nk * dk, kernel)), split)
        self.conv_k = declare_(nn.Parameter(torch.empty(self.nk * dk, kernel)), split)
        self.conv_v = declare_(nn.Parameter(torch.empty(self.nk * r * dv, kernel)), split)
        self.A_log = declare_(nn.Parameter(torch.empty(self.nk * r)), split)
        self.dt_bias = declare_(nn.Parameter(torch.empty(self.nk * r)), split)
        self.norm = declare_copies_(nn.RMSNorm(dv, eps=config.norm_eps), g.tp, True)
        self.out_proj = RowParallelLinear(nk * r * dv, config.hidden, g.tp, input_is_parallel=True,
                                          sequence_parallel=self.sp)
        # [model].recompute's core_attn: the conv, the gates and the delta rule rerun in the backward
        self.selective, self.backend = context.recomputes("core_attn", index), context.backend

    def _cp_groups(self):
        """(the group the all-to-all splits the key heads over, the group the state passes along), each None
        where it has one rank."""
        def live(group):
            return None if group is None or torch.distributed.get_world_size(group) == 1 else group

        if self.cp_mode == "a2a":
            return live(self.cp_group), None
        if self.cp_mode == "a2a+p2p":
            return live(self.hcp[0]), live(self.hcp[1])
        return None, live(self.cp_group)

    def _positions(self, docs, cp, device):
        """Each token's position within its document (the conv window's limit), or None (one document)."""
        if docs is None or docs.cu_seqlens is None:
            return None
        rank, size = (0, 1) if cp is None else (torch.distributed.get_rank(cp), torch.distributed.get_world_size(cp))
        return torch.stack([position_ids(self.seq_len, rank, size, cu_seqlens=c) for c in docs.cu_seqlens], 1).to(device)

    def _to_heads(self, packed, heads, cp):
        """``[S/P, B, key heads, w]`` -> this rank's ``1/P`` of the key heads over the tokens of the all-to-all
        group (all of them; under a2a+p2p the outer ring's pieces), in sequence order; and the inverse order."""
        p = torch.distributed.get_world_size(heads)
        outer, n_outer = (0, 1) if cp is None else (torch.distributed.get_rank(cp), torch.distributed.get_world_size(cp))
        segments = [shard_segments(self.seq_len, c, p * n_outer) for c in range(outer * p, (outer + 1) * p)]
        order, inverse, _ = gathered_order(segments, packed.device)
        return SeqToHeads.apply(packed, heads).index_select(0, order), inverse

    def forward(self, x: torch.Tensor, docs=None) -> torch.Tensor:
        c = self.config
        dk, dv, nk, r = c.linear_key_dim, c.linear_value_dim, self.nk, self.r
        x = enter_tensor_parallel_region(x, self.tp_group, self.sp)
        s, b = x.shape[:2]
        qkvz = self.in_proj_qkvz.forward_local(x).view(s, b, nk, -1)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        beta, a = self.in_proj_ba.forward_local(x).view(s, b, nk, 2 * r).split([r, r], dim=-1)
        if self.selective and torch.is_grad_enabled():
            o = checkpointed(self._core, q, k, v, beta, a, docs, x.dtype, backend=self.backend, replay=False)
        else:
            o = self._core(q, k, v, beta, a, docs, x.dtype)
        o = self.norm(o) * F.silu(z.reshape(*z.shape[:2], -1, dv))
        return self.out_proj(o.reshape(*o.shape[:2], -1))

    def _core(self, q, k, v, beta, a, docs, dtype):
        """The conv, the gates and the delta rule (the all-to-all's there and back included): ``[S, B, value
        heads, dv]`` of this rank's tokens."""
        c = self.config
        dk, dv, nk, r = c.linear_key_dim, c.linear_value_dim, self.nk, self.r
        s, b = q.shape[:2]
        weight = torch.cat([self.conv_q, self.conv_k, self.conv_v])
        A_log, dt_bias = self.A_log, self.dt_bias
        heads, cp = self._cp_groups()
        if heads is not None:  # all-to-all: the whole sequence of 1/P of the key heads, with their weights
            packed, inverse = self._to_heads(torch.cat([q, k, v, beta, a], -1), heads, cp)
            p, j = torch.distributed.get_world_size(heads), torch.distributed.get_rank(heads)
            nk, s = nk // p, packed.shape[0]
            q, k, v, beta, a = packed.split([dk, dk, r * dv, r, r], dim=-1)
            wq, wk, wv = weight.split([self.nk * dk, self.nk * dk, self.nk * r * dv])
            weight = torch.cat([w.narrow(0, j * len(w) // p, len(w) // p) for w in (wq, wk, wv)])
            A_log, dt_bias = (t.narrow(0, j * nk * r, nk * r) for t in (A_log, dt_bias))
        mixed = torch.cat([q.reshape(s, b, -1), k.reshape(s, b, -1), v.reshape(s, b, -1)], -1)
        mixed = F.silu(causal_conv1d(mixed, weight, cp, self.seq_len, positions=self._positions(docs, cp, q.device)))
        q, k, v = mixed.split([nk * dk, nk * dk, nk * r * dv], dim=-1)
        q = l2norm(q.float().view(s, b, nk, dk)) * dk ** -0.5
        k = l2norm(k.float().view(s, b, nk, dk))
        q, k = (t.repeat_interleave(r, dim=2) for t in (q, k))  # a key head serves r value heads
        v = v.reshape(s, b, nk * r, dv)
        g = -A_log.float().exp() * F.softplus(a.reshape(s, b, -1).float() + dt_bias)
        beta = beta.reshape(s, b, -1).sigmoid()
        heads_first = [t.permute(1, 2, 0, 3) for t in (q, k, v)] + [t.permute(1, 2, 0) for t in (g, beta)]  # [B, H, S, ...]
        o = context_parallel_delta_rule(*heads_first, cp, self.seq_len, cu_seqlens=None if docs is None else docs.cu_seqlens)
        o = o.permute(2, 0, 1, 3).to(dtype)  # [S, B, H, dv]
        if heads is not None:  # back to this rank's tokens, all heads
            o = HeadsToSeq.apply(o.index_select(0, inverse), heads)
        return o
