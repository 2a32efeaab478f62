"""QK-clip (MuonClip, Kimi K2): ``[train].muon_qk_clip = tau``.

During the step's forwards each attention core keeps, per local query head h, the largest
pre-softmax logit ``S_h = max scale * q_i . k_j`` over the (causal, same-document) pairs it attends,
as a running max on the device (:class:`HeadLogitMax`; no host read). After the optimizer update,
before the params are re-assembled, :func:`clip_scales` takes the max over the ranks that split the
batch and the sequence (one all-reduce MAX over dp x cp; TP ranks hold other heads, pipeline stages
other layers: nothing to share) and every head with ``S_h > tau`` gets ``gamma_h = tau / S_h``:

- multi-head attention (a key head per query head): W_q's and W_k's rows of head h times
  ``sqrt(gamma_h)`` (Kimi K2's per-head split);
- grouped-query attention (a key head shared by a group of query heads): W_q's rows of head h times
  ``gamma_h``, the shared W_k untouched, as Kimi K2 treats MLA's key shared by every head (its
  rotary part): each head's logit falls by exactly its own gamma, and no other head's changes.

The logits are computed again here, since the fused attention kernels never expose them: per
layer and micro-batch one extra ``q k^T`` over the full square (2 S^2 B Hq D FLOPs: about 1/6 of the
attention's forward and backward, counted without causal skipping; in query chunks of at most
``CHUNK`` logits), and under CP one all-gather of k over the cp group (S B Hkv D elements).
tools/bench/bench_muon.py measures the whole cost (``dp2-qkclip``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from par_groups import comm

CHUNK = 1 << 24  # logits per piece (64 MiB in fp32): the full [S, S] per head would not fit at long contexts


def head_logit_max(q: torch.Tensor, k: torch.Tensor, scale: float, q_index: torch.Tensor, k_index: torch.Tensor,
                   q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """``[Hq]``: per query head the largest ``scale * q_i . k_j`` over the pairs with
    ``k_index[j] <= q_index[i]`` (and ``k_doc[j] == q_doc[i]``, docs ``[S, B]``); q ``[Sq, B, Hq, D]``,
    k ``[Sk, B, Hkv, D]``; -inf where a head attends nothing."""
    sq, b, hq, d = q.shape
    hkv = k.shape[2]
    q = q.detach().float().reshape(sq, b, hkv, hq // hkv, d)  # query head i reads key head i // group
    k = k.detach().float()
    rows = max(1, CHUNK // max(1, k.shape[0] * b * hq))
    out = torch.full((hkv, hq // hkv), -math.inf, device=q.device)
    for i in range(0, sq, rows):
        logits = torch.einsum("sbkgd,tbkd->bkgst", q[i:i + rows], k)  # [B, Hkv, group, s, t]
        allowed = k_index[None, :] <= q_index[i:i + rows, None]  # [s, t]
        if q_doc is not None:  # [s, t, B] -> [B, 1, 1, s, t]
            allowed = (allowed[..., None] & (q_doc[i:i + rows, None, :] == k_doc[None, :, :])).permute(2, 0, 1)
            allowed = allowed[:, None, None]
        out = torch.maximum(out, logits.masked_fill(~allowed, -math.inf).amax(dim=(0, 3, 4)))
    return out.reshape(hq) * scale  # a positive scale commutes with the max (rounding is monotone)


class HeadLogitMax:
    """The running per-head max of one attention core (GQA's RopeThenContextAttention) over a step."""

    def __init__(self, attn, seq_len: int) -> None:
        self.attn, self.seq_len = attn, seq_len
        self.value: torch.Tensor | None = None  # [local query heads], on the device of q
        self._q_index: torch.Tensor | None = None  # the global index of this rank's tokens
        self._k_index: torch.Tensor | None = None  # the global index of every gathered key (cp order)

    @torch.compiler.disable  # eager under [train].compile: a running max held outside the graph
    def observe(self, q: torch.Tensor, k: torch.Tensor, docs) -> None:
        from par_cp import position_ids

        scale = self.attn.softmax_scale if self.attn.softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
        rank, cp = self.attn.cp_rank_and_size
        if self._q_index is None or self._q_index.device != q.device:  # this shard's tokens: fixed
            self._q_index = position_ids(self.seq_len, rank, cp, layout=self.attn.layout).to(q.device)
        q_index = self._q_index
        if cp > 1:  # every key of the sequence: the ranks of the group hold the other shards
            group = self.attn.cp_group
            gathered = torch.empty((cp * k.shape[0], *k.shape[1:]), dtype=k.dtype, device=k.device)
            comm.all_gather_into_tensor(gathered, k.detach().contiguous(), group)
            k = gathered
            if self._k_index is None or self._k_index.device != q.device:
                every = torch.empty(cp * q_index.numel(), dtype=q_index.dtype, device=q.device)
                comm.all_gather_into_tensor(every, q_index, group)
                self._k_index = every
            k_index = self._k_index
        else:
            k_index = q_index
        q_doc = k_doc = None
        if docs is not None and docs.cu_seqlens is not None:  # [S, B]: each token's document
            index = torch.arange(self.seq_len, device=q.device)
            doc = torch.stack([torch.bucketize(index, torch.tensor(c[1:-1], device=q.device), right=True)
                               for c in docs.cu_seqlens], dim=1)
            q_doc, k_doc = doc[q_index], doc[k_index]
        m = head_logit_max(q, k, scale, q_index, k_index, q_doc, k_doc)
        self.value = m if self.value is None else torch.maximum(self.value, m)

    def take(self, heads: int, device) -> torch.Tensor:
        """The step's max (-inf where no forward ran), and a fresh start for the next step."""
        value = self.value if self.value is not None else torch.full((heads,), -math.inf, device=device)
        self.value = None
        return value


def attentions(module: nn.Module) -> list:
    """The GQA attention blocks (par_tp.TPAttention) whose core tracks its logits, in module order."""
    return [m for m in module.modules() if getattr(getattr(m, "core", None), "logit_max", None) is not None]


@torch.no_grad()
def clip_scales(module: nn.Module, tau: float, group) -> dict[nn.Parameter, torch.Tensor]:
    """``{W_q or W_k: the factor of each of its (local) rows}`` for the step just taken; resets the trackers.
    One all-reduce MAX over ``group`` (dp x cp: the ranks splitting the batch and the sequence)."""
    blocks = attentions(module)
    if not blocks:
        return {}
    device = blocks[0].wq.weight.device
    maxes = torch.cat([b.core.logit_max.take(b.local_heads, device) for b in blocks])
    if group is not None and dist.get_world_size(group) > 1:
        comm.all_reduce(maxes, group, op=dist.ReduceOp.MAX)
    gamma = torch.where(maxes > tau, tau / maxes, torch.ones_like(maxes))
    out, at = {}, 0
    for b in blocks:
        g, at = gamma[at:at + b.local_heads], at + b.local_heads
        if b.num_heads == b.num_kv_heads:  # multi-head: sqrt(gamma) on each side; the key heads are the query heads'
            out[b.wq.weight] = out[b.wk.weight] = g.sqrt().repeat_interleave(b.head_dim)
        else:  # grouped: the whole gamma on the query head, the shared key untouched
            out[b.wq.weight] = g.repeat_interleave(b.head_dim)
    return out


def reset_logit_max(module: nn.Module) -> None:
    """Forget the step's maxes (a skipped step: its forwards are not the next step's)."""
    for b in attentions(module):
        b.core.logit_max.value = None
