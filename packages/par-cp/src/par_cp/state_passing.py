"""Context parallelism for linear attention (Gated DeltaNet): a recurrent state passed along the sequence.

Softmax attention's ring and all-to-all do not apply: a token sees the past only through one state per
head (``[dk, dv]``). The sequence is cut into pieces (``sharding.py``: zigzag gives each rank two);
each rank, in parallel, runs the chunked rule over its pieces from a zero state and gets every piece's
affine form (``delta_rule.affine_delta_rule``): its local end state and output, and the transition ``A``
and the queries ``Q~`` through which an incoming state acts. Then the states pass along the pieces in
sequence order, ``S_end = S_local + A S_in``, one ``[B, H, dk, dv]`` message per boundary between pieces
held by different ranks (cheap: no token is touched), and each piece adds ``Q~ S_in`` to its output.
Backward runs the pass in reverse: a piece receives the gradient of its end state from the next piece,
``dS_in = dS_in(outputs) + A^T dS_end``, and sends that to the previous piece's rank; ``A`` gets
``dS_end S_in^T`` and ``S_local`` gets ``dS_end``. Bytes per boundary, both ways: one state.

Packed documents: a document start inside a piece resets the state there (the piece's ``A`` is zero, its
``Q~`` zero from that token on), and one at a piece's first token resets the incoming state (``A`` and
``Q~`` zero). The short causal conv before the rule needs the ``kernel - 1`` tokens before each piece: the
halo, received from the rank holding the previous piece (:func:`causal_conv1d`); its window stays inside
the token's document.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from par_groups import comm

from .delta_rule import affine_delta_rule, chunked_delta_rule
from .sharding import shard_segments


def _pieces(seq_len: int, cp: int, layout: str) -> list[tuple[int, int, int, int]]:
    """Every piece of the sequence in order: (start, end, holder rank, index among the holder's pieces)."""
    out = [(a, b, r, i) for r in range(cp) for i, (a, b) in enumerate(shard_segments(seq_len, r, cp, layout))]
    return sorted(out)


def halo_sources(pieces) -> dict[tuple[int, int], tuple[int, int] | None]:
    """(rank, piece index) -> the (rank, piece index) whose last tokens it continues (None: the sequence's start)."""
    return {(r, i): (None if n == 0 else pieces[n - 1][2:]) for n, (_, _, r, i) in enumerate(pieces)}


def _compose(s_local, a, s_in):
    """The end state of a piece from its incoming state."""
    return s_local + a @ s_in


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r)


def _send(t, group, peer: int):
    return comm.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), _global(group, peer), group)])


def _recv(like, group, peer: int):
    buf = torch.empty_like(like)
    for w in comm.batch_isend_irecv([dist.P2POp(dist.irecv, buf, _global(group, peer), group)]):
        w.wait()
    return buf


class _PassStates(torch.autograd.Function):
    """Forward: the incoming state of each of this rank's pieces (the pass along the pieces); backward: the reverse pass."""

    @staticmethod
    def forward(ctx, group, pieces, rank, *tensors):
        n = len(tensors) // 2
        s_local, a = tensors[:n], tensors[n:]
        mine = [p for p in range(len(pieces)) if pieces[p][2] == rank]
        s_in, end, works = [None] * n, None, []
        for p in mine:
            i = pieces[p][3]
            if p == 0:
                s = torch.zeros_like(s_local[i])
            elif pieces[p - 1][2] == rank:
                s = end
            else:
                s = _recv(s_local[i], group, pieces[p - 1][2])
            s_in[i] = s
            end = _compose(s_local[i], a[i], s)
            if p + 1 < len(pieces) and pieces[p + 1][2] != rank:
                works += _send(end, group, pieces[p + 1][2])
        for w in works:
            w.wait()
        ctx.group, ctx.pieces, ctx.rank, ctx.mine = group, pieces, rank, mine
        ctx.save_for_backward(*a, *s_in)
        return tuple(s_in)

    @staticmethod
    def backward(ctx, *grads):
        group, pieces, rank = ctx.group, ctx.pieces, ctx.rank
        n = len(grads)
        saved = ctx.saved_tensors  # read once: a checkpointed region's saved tensors unpack once
        a, s_in = saved[:n], saved[n:]
        d_local, d_a, d_in_next, works = [None] * n, [None] * n, None, []
        for p in reversed(ctx.mine):
            i = pieces[p][3]
            if p + 1 == len(pieces):
                d_end = torch.zeros_like(s_in[i])
            elif pieces[p + 1][2] == rank:
                d_end = d_in_next
            else:
                d_end = _recv(s_in[i], group, pieces[p + 1][2])
            d_local[i], d_a[i] = d_end, d_end @ s_in[i].transpose(-1, -2)
            d_in_next = (0 if grads[i] is None else grads[i]) + a[i].transpose(-1, -2) @ d_end
            if p > 0 and pieces[p - 1][2] != rank:
                works += _send(d_in_next, group, pieces[p - 1][2])
        for w in works:
            w.wait()
        return (None, None, None, *d_local, *d_a)


def _doc_starts(cu_seqlens, batch: int) -> list[list[int]] | None:
    if cu_seqlens is None:
        return None
    seqs = list(cu_seqlens) if not isinstance(cu_seqlens[0], int) else [cu_seqlens] * batch
    return [sorted(int(s) for s in seq) for seq in seqs]


def resets_at_piece_start(starts: list[int], a: int) -> bool:
    """A document starts at the piece's first token: the incoming state is dropped."""
    return a in starts


def _piece_affine(q, k, v, g, beta, a: int, starts: list[int] | None):
    """One piece (global tokens ``[a, a + T)``) of one sequence or of all: (O_local, Q~, S_local, A)."""
    inside = [] if starts is None else [s - a for s in starts if a < s < a + k.shape[2]]
    carry = a > 0 and (starts is None or not resets_at_piece_start(starts, a))  # the sequence's start: nothing comes in
    cuts = [0, *inside, k.shape[2]]
    outs, qt, s, trans = [], None, None, None
    for j, (x, y) in enumerate(zip(cuts, cuts[1:])):
        part = [t[:, :, x:y] for t in (q, k, v, g, beta)]
        if j == 0 and carry:
            o, qt, s, trans = affine_delta_rule(*part)
        else:
            o, s = chunked_delta_rule(*part)
        outs.append(o)
    b, h, t, dk = k.shape
    qt = q.new_zeros(b, h, 0, dk, dtype=torch.float32) if qt is None else qt
    qt = torch.cat([qt, qt.new_zeros(b, h, t - qt.shape[2], dk)], 2)
    if trans is None or len(cuts) > 2:  # a document starts in the piece: nothing comes through
        trans = q.new_zeros(b, h, dk, dk, dtype=torch.float32)
    return torch.cat(outs, 2), qt, s, trans


def context_parallel_delta_rule(q, k, v, g, beta, cp_group=None, seq_len: int | None = None, layout: str = "zigzag",
                                cu_seqlens=None):
    """The gated delta rule over a sequence sharded across ``cp_group``: ``q, k [B, H, T, dk]``, ``v [B, H, T, dv]``,
    ``g, beta [B, H, T]``, this rank's tokens in ``shard_segments`` order; returns ``O [B, H, T, dv]`` (fp32).
    ``cu_seqlens``: document boundaries of the full sequence (one tuple, or one per sequence) reset the state."""
    with torch.autocast(q.device.type, enabled=False):  # fp32 throughout, the composition's matmuls too
        return _delta_rule(q, k, v, g, beta, cp_group, seq_len, layout, cu_seqlens)


def _delta_rule(q, k, v, g, beta, cp_group, seq_len, layout, cu_seqlens):
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    rank = 0 if cp == 1 else dist.get_rank(cp_group)
    layout = "contiguous" if cp == 1 else layout  # one rank: the whole sequence is one piece
    t = k.shape[2]
    seq_len = seq_len or t * cp
    starts = _doc_starts(cu_seqlens, k.shape[0])
    pieces = _pieces(seq_len, cp, layout)
    mine = [p for p in pieces if p[2] == rank]
    offset, parts = 0, []
    for a, b, _, _ in mine:
        sl = [x[:, :, offset:offset + b - a] for x in (q, k, v, g, beta)]
        if starts is None:
            parts.append(_piece_affine(*sl, a, None))
        else:  # each sequence its own documents
            per = [_piece_affine(*(x[j:j + 1] for x in sl), a, starts[j]) for j in range(k.shape[0])]
            parts.append(tuple(torch.cat(z, 0) for z in zip(*per)))
        offset += b - a
    if cp == 1 and len(mine) == 1:
        return parts[0][0]
    s_in = _PassStates.apply(cp_group, pieces, rank, *(p[2] for p in parts), *(p[3] for p in parts))
    return torch.cat([o + qt @ s for (o, qt, _, _), s in zip(parts, s_in)], 2)


class _Halo(torch.autograd.Function):
    """Forward: each piece receives the tail of the piece before it; backward: the tails' gradients go home."""

    @staticmethod
    def forward(ctx, group, routes, *tails):
        recv_from, send_to = routes  # tagged by the receiving piece's index
        bufs = {i: torch.empty_like(tails[i]) for i in recv_from}
        ops = [dist.P2POp(dist.isend, tails[i].contiguous(), _global(group, r), group, tag=j) for i, r, j in send_to]
        ops += [dist.P2POp(dist.irecv, bufs[i], _global(group, r), group, tag=i) for i, r in recv_from.items()]
        for w in comm.batch_isend_irecv(ops) if ops else []:
            w.wait()
        ctx.group, ctx.routes = group, routes
        return tuple(bufs.get(i, torch.zeros_like(t)) for i, t in enumerate(tails))

    @staticmethod
    def backward(ctx, *grads):
        recv_from, send_to = ctx.routes
        group = ctx.group
        back = [torch.empty_like(grads[i]) for i, _, _ in send_to]
        ops = [dist.P2POp(dist.isend, grads[i].contiguous(), _global(group, r), group, tag=i) for i, r in recv_from.items()]
        ops += [dist.P2POp(dist.irecv, buf, _global(group, r), group, tag=j) for buf, (_, r, j) in zip(back, send_to)]
        for w in comm.batch_isend_irecv(ops) if ops else []:
            w.wait()
        out = [torch.zeros_like(g) for g in grads]
        for buf, (i, _, _) in zip(back, send_to):
            out[i] = out[i] + buf
        return (None, None, *out)


def causal_conv1d(x, weight, cp_group=None, seq_len: int | None = None, layout: str = "zigzag", positions=None):
    """Depthwise causal convolution ``out[t] = sum_j weight[:, K-1-j] x[t-j]`` over a CP-sharded sequence:
    ``x [T, B, C]`` (this rank's tokens), ``weight [C, K]``. ``positions [T, B]`` (within each document):
    the window stops at the token's document start. Each piece's ``K-1`` earlier tokens come from the rank
    holding the piece before it (:func:`halo_sources`)."""
    cp = 1 if cp_group is None else dist.get_world_size(cp_group)
    rank = 0 if cp == 1 else dist.get_rank(cp_group)
    layout = "contiguous" if cp == 1 else layout  # one rank: the whole sequence is one piece
    t, kernel = x.shape[0], weight.shape[1]
    seq_len = seq_len or t * cp
    pieces = _pieces(seq_len, cp, layout)
    mine = [p for p in pieces if p[2] == rank]
    offset, local = 0, []
    for a, b, _, _ in mine:
        local.append(x[offset:offset + b - a])
        offset += b - a
    if min(len(p) for p in local) < kernel - 1:
        raise ValueError(f"pieces of {min(len(p) for p in local)} tokens are shorter than the conv's kernel - 1 = {kernel - 1}")
    sources = halo_sources(pieces)
    tails = [p[len(p) - kernel + 1:] for p in local]
    halos: list = [None] * len(local)
    recv_from, send_to = {}, []
    for (r, i), src in sources.items():
        if r == rank and src is not None and src[0] == rank:
            halos[i] = tails[src[1]]
        elif r == rank and src is not None:
            recv_from[i] = src[0]
        elif src is not None and src[0] == rank:
            send_to.append((src[1], r, i))
    if recv_from or send_to:  # a piece at the sequence's start takes its zeros from here too: a rank that
        # only sends still runs the exchange's backward (an unused output would skip it, and its peer would wait)
        got = _Halo.apply(cp_group, (recv_from, send_to), *tails)
        halos = [got[i] if i in recv_from or h is None else h for i, h in enumerate(halos)]
    halos = [torch.zeros_like(tails[i]) if h is None else h for i, h in enumerate(halos)]
    wide = torch.cat([torch.cat([h, p]) for h, p in zip(halos, local)])  # each piece after its halo
    index = torch.cat([torch.arange(len(p), device=x.device) + sum(len(q) + kernel - 1 for q in local[:n]) + kernel - 1
                       for n, p in enumerate(local)])
    out = 0
    for j in range(kernel):
        term = wide[index - j] * weight[:, kernel - 1 - j]
        if positions is not None:
            term = term * (positions >= j)[..., None].to(term.dtype)
        out = out + term
    return out
