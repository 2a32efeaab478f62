"""Async tensor parallelism: sequence-parallel collectives overlapped with the matmuls they feed.

With sequence parallelism a column-parallel block starts with an all-gather of the sequence and a
row-parallel block ends with a reduce-scatter. Here each is a ring of ``tp`` steps instead of
one collective (Megatron's ``--tp-comm-overlap``, torch's async TP): at every step a sequence
chunk travels to the next rank while this rank multiplies the chunk it already has, so only
one chunk's transfer is exposed. The math is the unsplit layer's: the chunks are rows of the
same products; only the order of the reduce-scatter's sum differs (fp32 rounding).

    all_gather_matmul(x_local, [W1, W2, ...])  forward: ring all-gather x, F.linear per chunk;
                                               backward: ring reduce-scatter of dx, dW per chunk
    matmul_reduce_scatter(x, W)                forward: F.linear per chunk, ring reduce-scatter;
                                               backward: ring all-gather of dy, dx and dW per chunk
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from par_groups import comm


def _shift(send: torch.Tensor, recv: torch.Tensor, group: ProcessGroup) -> list:
    """Send ``send`` to the next rank of the ring and receive ``recv`` from the previous one."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    return comm.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)])


def ring_all_gather(x_local: torch.Tensor, on_chunk: Callable[[int, torch.Tensor], None], group: ProcessGroup) -> torch.Tensor:
    """All-gather dim 0 around the ring, calling ``on_chunk(source_rank, chunk)`` on each chunk as
    it arrives (while the next one travels). Returns the gathered tensor, in rank order."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    chunks: list[torch.Tensor | None] = [None] * n
    cur, src = x_local.contiguous(), r
    for step in range(n):
        works = []
        if step < n - 1:
            nxt = torch.empty_like(cur)
            works = _shift(cur, nxt, group)
        chunks[src] = cur
        on_chunk(src, cur)  # overlaps the transfer
        for w in works:
            w.wait()
        if works:
            cur, src = nxt, (src - 1) % n
    return torch.cat(chunks, dim=0)


def ring_reduce_scatter(partial: Callable[[int], torch.Tensor], group: ProcessGroup) -> torch.Tensor:
    """This rank's chunk of ``sum over ranks of partial(chunk)``; each rank computes its partial
    for chunk ``c`` while the running sum for ``c`` travels to it."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    acc = partial((r - 1) % n)
    for step in range(1, n):
        received = torch.empty_like(acc)
        works = _shift(acc, received, group)
        mine = partial((r - step - 1) % n)  # overlaps the transfer
        for w in works:
            w.wait()
        acc = received + mine
    return acc


def _rows(x: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    size = x.shape[0] // n
    return x[chunk * size:(chunk + 1) * size]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, group, n_weights, *weights_and_biases):
        weights, biases = weights_and_biases[:n_weights], weights_and_biases[n_weights:]
        n = dist.get_world_size(group)
        outs: list[list[torch.Tensor | None]] = [[None] * n for _ in weights]

        def multiply(src, chunk):
            for i, (w, b) in enumerate(zip(weights, biases)):
                outs[i][src] = F.linear(chunk, w, b)

        x_full = ring_all_gather(x_local, multiply, group)
        ctx.group, ctx.n_weights, ctx.has_bias = group, n_weights, [b is not None for b in biases]
        ctx.save_for_backward(x_full, *weights)
        return tuple(torch.cat(o, dim=0) for o in outs)

    @staticmethod
    def backward(ctx, *grad_ys):
        x_full, *weights = ctx.saved_tensors
        group, n = ctx.group, dist.get_world_size(ctx.group)
        grad_ws = [torch.zeros_like(w) for w in weights]

        def partial(c):  # this rank's share of dx for chunk c, and the chunk's dW on the way
            x_c, dx = _rows(x_full, c, n), None
            for i, (g, w) in enumerate(zip(grad_ys, weights)):
                if g is None:  # an output nothing used
                    continue
                g_c = _rows(g, c, n)
                grad_ws[i] += _flat(g_c).t() @ _flat(x_c)
                dx = g_c @ w if dx is None else dx + g_c @ w
            return dx if dx is not None else torch.zeros_like(x_c)

        grad_x = ring_reduce_scatter(partial, group)
        grad_bs = [_flat(g).sum(0) if has and g is not None else None for g, has in zip(grad_ys, ctx.has_bias)]
        return (grad_x, None, None, *grad_ws, *grad_bs)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        n = dist.get_world_size(group)
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return ring_reduce_scatter(lambda c: F.linear(_rows(x, c, n), weight), group)

    @staticmethod
    def backward(ctx, grad_y_local):
        x, weight = ctx.saved_tensors
        n = dist.get_world_size(ctx.group)
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight)

        def on_chunk(src, g):
            _rows(grad_x, src, n).copy_(g @ weight)
            grad_w.add_(_flat(g).t() @ _flat(_rows(x, src, n)))

        ring_all_gather(grad_y_local, on_chunk, ctx.group)
        return grad_x, grad_w, None


def all_gather_matmul(x_local: torch.Tensor, weights: list[torch.Tensor], group: ProcessGroup,
                      biases: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, ...]:
    """``F.linear(all_gather_dim0(x_local), W_i, b_i)`` for each weight, the gather overlapped with
    the matmuls; the input grad is reduce-scattered (the outputs feed tensor-parallel work)."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    if dist.get_world_size(group) == 1:
        return tuple(F.linear(x_local, w, b) for w, b in zip(weights, biases))
    if x_local.shape[0] == 0:
        raise ValueError("all_gather_matmul needs a non-empty sequence shard")
    return _AllGatherMatmul.apply(x_local, group, len(weights), *weights, *biases)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``reduce_scatter_dim0(F.linear(x, weight))`` with the matmul chunked under the ring."""
    n = dist.get_world_size(group)
    if n == 1:
        return F.linear(x, weight)
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {n}")
    return _MatmulReduceScatter.apply(x, weight, group)
