"""par-cp on a CUDA GPU: the flash-attn path, checked and timed against single-device flash-attn.

One GPU cannot host several NCCL ranks, so the CP ranks' work is emulated in one process with
the very code the ring runs on each rank (segments_forward / segments_backward per key/value
shard), minus the transfers. It checks:

1. correctness: zigzag ring (cp=4, causal, GQA, bf16) and packed documents, output and
   dQ/dK/dV against flash-attn on the full sequence (bf16 tolerance);
2. throughput: each emulated rank's fwd / fwd+bwd time with the flash kernel; efficiency =
   t(single-device flash on S) / (cp * slowest rank); and the cp=1 module against calling
   flash_attn_func directly (overhead of our wrapper).

    uv run python tools/gpu/cp_flash_check.py [--seq 16384 --cp 4]   (needs flash-attn)

Ends with RESULT lines. Exits 0 with a message when CUDA or flash-attn is missing.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def bench(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except Exception as e:
        print(f"flash-attn not importable ({type(e).__name__}: {e}); install the gpu extra")
        return 0
    from par_cp import ContextParallelAttention, flash_available, shard_segments
    from par_cp.kernels import choose_kernel
    from par_cp.kernels.mask import BlockMask
    from par_cp.segments import segments_backward, segments_forward

    assert flash_available()
    torch.manual_seed(0)
    S, cp, H, Hkv, D = args.seq, args.cp, args.heads, args.kv_heads, args.dim
    dev, dt = "cuda", torch.bfloat16
    scale = D ** -0.5
    q = torch.randn(S, 1, H, D, device=dev, dtype=dt)
    k, v = (torch.randn(S, 1, Hkv, D, device=dev, dtype=dt) for _ in range(2))
    dout = torch.randn_like(q)
    assert choose_kernel("auto", q[:8], BlockMask(0, 8, 0, 8, True)) == "flash"

    def full_flash(docs=None):
        qq, kk, vv = (t.detach().transpose(0, 1).requires_grad_() for t in (q, k, v))
        if docs is None:
            o = flash_attn_func(qq, kk, vv, causal=True, softmax_scale=scale)
        else:
            cu = torch.tensor(docs, dtype=torch.int32, device=dev)
            mx = max(b - a for a, b in zip(docs, docs[1:]))
            o = flash_attn_varlen_func(qq[0], kk[0], vv[0], cu, cu, mx, mx, causal=True, softmax_scale=scale)[None]
        o.backward(dout.transpose(0, 1))
        return [t.transpose(0, 1) for t in (o.detach(), qq.grad, kk.grad, vv.grad)]

    segs = [shard_segments(S, r, cp, "zigzag") for r in range(cp)]
    idx = [torch.cat([torch.arange(a, b) for a, b in s]).to(dev) for s in segs]

    def rank_work(r, docs, backward):
        """What ring rank r computes: its queries against every shard, then the backward."""
        ql = q[idx[r]]
        out = lse = None
        for src in range(cp):
            out, lse = segments_forward(ql, k[idx[src]], v[idx[src]], segs[r], segs[src], True, docs, scale, "auto", out, lse)
        if not backward:
            return out, None
        out = out.to(dt)
        dq, dkv = None, []
        for src in range(cp):
            dq, dk, dv = segments_backward(dout[idx[r]], ql, k[idx[src]], v[idx[src]], out, lse, segs[r], segs[src], True, docs, scale, "auto", dq)
            dkv.append((src, dk, dv))
        return out, (dq, dkv)

    failures = []
    for docs in (None, (0, 1000, 5000, S // 2 + 7, S)):
        ref_out, ref_dq, ref_dk, ref_dv = full_flash(docs)
        dq_all = torch.zeros_like(q, dtype=torch.float32)
        dk_all = torch.zeros_like(k, dtype=torch.float32)
        dv_all = torch.zeros_like(v, dtype=torch.float32)
        out_err = 0.0
        for r in range(cp):
            out, (dq, dkv) = rank_work(r, docs, True)
            out_err = max(out_err, rel(out, ref_out[idx[r]]))
            dq_all[idx[r]] += dq
            for src, dk, dv in dkv:
                dk_all[idx[src]] += dk
                dv_all[idx[src]] += dv
        errs = {"out": out_err, "dq": rel(dq_all, ref_dq), "dk": rel(dk_all, ref_dk), "dv": rel(dv_all, ref_dv)}
        name = "packed" if docs else "causal"
        print(f"ring cp={cp} zigzag {name} bf16 vs flash-attn full sequence: " + ", ".join(f"{k}={e:.2e}" for k, e in errs.items()))
        if max(errs.values()) > 2e-2:
            failures.append(name)

    t_full_f = bench(lambda: flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True))
    t_full_t = bench(lambda: full_flash())
    t_rank_f = [bench(lambda r=r: rank_work(r, None, False), 5) for r in range(cp)]
    t_rank_t = [bench(lambda r=r: rank_work(r, None, True), 5) for r in range(cp)]
    eff_f = t_full_f / (cp * max(t_rank_f))
    eff_t = t_full_t / (cp * max(t_rank_t))
    print(f"S={S} H={H} Hkv={Hkv} D={D} bf16 causal: single-device flash fwd {t_full_f * 1e3:.2f} ms, fwd+bwd {t_full_t * 1e3:.2f} ms")
    print(f"per-rank ring compute fwd ms {[round(t * 1e3, 2) for t in t_rank_f]}, fwd+bwd ms {[round(t * 1e3, 2) for t in t_rank_t]}")

    attn = ContextParallelAttention("p2p", None, causal=True)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    t_mod = bench(lambda: attn(qg, kg, vg).backward(dout))
    tok = S / t_full_t
    print(f"cp=1 module fwd+bwd {t_mod * 1e3:.2f} ms vs flash_attn_func {t_full_t * 1e3:.2f} ms")
    print(f"RESULT flash_ring_fwd efficiency={eff_f:.2f} tokens_per_s_single={S / t_full_f:.0f} tokens_per_s_cp={S / (max(t_rank_f)):.0f}")
    print(f"RESULT flash_ring_fwd_bwd efficiency={eff_t:.2f} tokens_per_s_single={tok:.0f} tokens_per_s_cp={S / max(t_rank_t):.0f}")
    print(f"RESULT flash_cp1_module time_module_over_flash_attn={t_mod / t_full_t:.2f}")
    print(f"RESULT flash_correct {'FAIL ' + ','.join(failures) if failures else 'ok'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
