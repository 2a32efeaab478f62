"""CUDA: par-cp's attention in bf16 equals the float64 reference on the CPU.

cp=1 takes the fused path (flash-attn's ``flash_attn_func`` when installed, else torch SDPA's
flash kernel); a zigzag ring of cp=4 is emulated in this process with the very per-shard code
every ring rank runs (``segments_forward`` / ``segments_backward`` against each key/value shard),
so its block kernels (flash-attn varlen or SDPA's flash kernel with LSE) are checked on one GPU.
"""

import pytest
import torch

from par_cp import ContextParallelAttention, shard_segments
from par_cp.reference import reference_attention
from par_cp.segments import segments_backward, segments_forward
from par_groups.testing.gpu import assert_bf16_close, gpu_device

pytestmark = pytest.mark.gpu
S, B, HQ, HKV, D = 256, 2, 8, 2, 64


def inputs(device):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, h, D, generator=g) for h in (HQ, HKV, HKV))
    dout = torch.randn(S, B, HQ, D, generator=g)
    return (q, k, v, dout), [t.to(device, torch.bfloat16) for t in (q, k, v, dout)]


def reference(q, k, v, dout):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = reference_attention(q, k, v, causal=True)
    out.backward(dout.double())
    return out, q.grad, k.grad, v.grad


def test_cp1_fused_attention_bf16_matches_fp64_reference():
    device = gpu_device()
    cpu, (q, k, v, dout) = inputs(device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ContextParallelAttention("p2p", None, causal=True)(q, k, v)
    out.backward(dout)
    for got, want, what in zip((out, q.grad, k.grad, v.grad), reference(*cpu), ("out", "dq", "dk", "dv")):
        assert_bf16_close(got, want, f"cp=1 {what}")


def test_emulated_zigzag_ring_bf16_matches_fp64_reference():
    device, cp, scale = gpu_device(), 4, D ** -0.5
    cpu, (q, k, v, dout) = inputs(device)
    segs = [shard_segments(S, r, cp, "zigzag") for r in range(cp)]
    idx = [torch.cat([torch.arange(a, b) for a, b in s]).to(device) for s in segs]
    shard = lambda t, r: t.index_select(0, idx[r])  # noqa: E731
    out, dq, dk, dv = (torch.zeros(S, B, h, D, device=device) for h in (HQ, HQ, HKV, HKV))
    for r in range(cp):  # each rank: its queries against every rank's key/value shard, merged by LSE
        o = lse = None
        for j in range(cp):
            o, lse = segments_forward(shard(q, r), shard(k, j), shard(v, j), segs[r], segs[j], True, None, scale,
                                      "auto", o, lse)
        out[idx[r]] = o
        g = None
        for j in range(cp):
            g, gk, gv = segments_backward(shard(dout, r), shard(q, r), shard(k, j), shard(v, j), o.to(q.dtype), lse,
                                          segs[r], segs[j], True, None, scale, "auto", g)
            dk[idx[j]] += gk
            dv[idx[j]] += gv
        dq[idx[r]] = g
    for got, want, what in zip((out, dq, dk, dv), reference(*cpu), ("out", "dq", "dk", "dv")):
        assert_bf16_close(got, want, f"ring cp={cp} {what}")
