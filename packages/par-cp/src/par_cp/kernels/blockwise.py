"""Pure-PyTorch attention kernel: online softmax over key tiles, fp32 math, any dtype, any device.

Forward returns the block's output and its log-sum-exp (LSE) per query; backward takes the
*final* output and LSE (after every block was merged) and returns this block's share of dQ,
dK, dV, exactly as flash-attention's backward does, so blockwise results add up to the full
gradient. GQA: query head h uses key/value head h // (Hq // Hkv).
"""

from __future__ import annotations

import torch

from .mask import BlockMask

KEY_TILE = 512


def _split_heads(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, B, Hq, D] -> [B, Hkv, G, S, D] fp32 and [S, B, Hkv, D] -> [B, Hkv, 1, S, D] fp32."""
    sq, b, hq, d = q.shape
    hkv = k.shape[2]
    qf = q.permute(1, 2, 0, 3).float().reshape(b, hkv, hq // hkv, sq, d)
    kf = k.permute(1, 2, 0, 3).float().unsqueeze(2)
    return qf, kf


def _scores(qf, kf, mask: BlockMask, lo: int, hi: int, scale: float):
    s = torch.matmul(qf, kf[..., lo:hi, :].transpose(-1, -2)) * scale
    m = mask.dense(lo, hi, device=qf.device)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    return s, m


def _tile_is_empty(mask: BlockMask, lo: int, hi: int) -> bool:
    """Whether no query sees keys lo..hi of the block, from the positions alone (no device sync)."""
    return BlockMask(mask.q_start, mask.q_end, mask.k_start + lo, mask.k_start + hi, mask.causal, mask.docs).is_empty()


def blockwise_forward(q, k, v, mask: BlockMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out [Sq, B, Hq, D] (fp32), lse [B, Hq, Sq] (fp32, -inf where a query sees no key)."""
    sq, b, hq, d = q.shape
    qf, kf = _split_heads(q, k)
    vf = v.permute(1, 2, 0, 3).float().unsqueeze(2)
    row_max = torch.full(qf.shape[:-1], float("-inf"), device=q.device)
    row_sum = torch.zeros(qf.shape[:-1], device=q.device)
    acc = torch.zeros(qf.shape, device=q.device)
    for lo in range(0, mask.k_len, KEY_TILE):
        hi = min(lo + KEY_TILE, mask.k_len)
        if _tile_is_empty(mask, lo, hi):
            continue
        s, m = _scores(qf, kf, mask, lo, hi, scale)
        new_max = torch.maximum(row_max, s.amax(-1))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe_max.unsqueeze(-1))
        alpha = torch.exp(row_max - safe_max)
        row_sum = row_sum * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + torch.matmul(p, vf[..., lo:hi, :])
        row_max = new_max
    seen = row_sum > 0
    out = torch.where(seen.unsqueeze(-1), acc / row_sum.clamp_min(1e-30).unsqueeze(-1), torch.zeros_like(acc))
    lse = torch.where(seen, row_max + torch.log(row_sum.clamp_min(1e-30)), torch.full_like(row_sum, float("-inf")))
    out = out.reshape(b, hq, sq, d).permute(2, 0, 1, 3)
    return out, lse.reshape(b, hq, sq)


def blockwise_backward(dout, q, k, v, out, lse, mask: BlockMask, scale: float):
    """dq [Sq, B, Hq, D], dk, dv [Sk, B, Hkv, D], all fp32; ``out``/``lse`` are the final ones."""
    sq, b, hq, d = q.shape
    hkv = k.shape[2]
    qf, kf = _split_heads(q, k)
    vf = v.permute(1, 2, 0, 3).float().unsqueeze(2)
    do, of = _split_heads(dout, k)[0], _split_heads(out, k)[0]
    lse = lse.float().reshape(b, hkv, hq // hkv, sq)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)  # unseen rows: p = 0
    delta = (do * of).sum(-1, keepdim=True)
    dq = torch.zeros_like(qf)
    dk = torch.zeros(b, hkv, mask.k_len, d, device=q.device)
    dv = torch.zeros_like(dk)
    for lo in range(0, mask.k_len, KEY_TILE):
        hi = min(lo + KEY_TILE, mask.k_len)
        if _tile_is_empty(mask, lo, hi):
            continue
        s, m = _scores(qf, kf, mask, lo, hi, scale)
        p = torch.exp(s - lse.unsqueeze(-1))
        dv[:, :, lo:hi] = torch.matmul(p.transpose(-1, -2), do).sum(2)
        dp = torch.matmul(do, vf[..., lo:hi, :].transpose(-1, -2))
        ds = p * (dp - delta)
        dq += torch.matmul(ds, kf[..., lo:hi, :]) * scale
        dk[:, :, lo:hi] = torch.matmul(ds.transpose(-1, -2), qf).sum(2) * scale
    dq = dq.reshape(b, hq, sq, d).permute(2, 0, 1, 3)
    return dq, dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)
