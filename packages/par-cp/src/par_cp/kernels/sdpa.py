"""torch's fused CPU attention (the kernel behind SDPA on CPU), which also returns the LSE.

It fits a block with one document and either no causal mask or a square diagonal block
(its causal mask is top-left aligned). GQA is handled by repeating key/value heads.
"""

from __future__ import annotations

import torch

from .mask import BlockMask


def sdpa_fits(q: torch.Tensor, mask: BlockMask) -> bool:
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if mask.doc_pairs() != [(0, mask.q_len, 0, mask.k_len)]:
        return False
    return not mask.kernel_causal() or mask.q_len == mask.k_len


def _bhsd(x: torch.Tensor, repeat: int) -> torch.Tensor:
    x = x.permute(1, 2, 0, 3)
    return (x.repeat_interleave(repeat, dim=1) if repeat > 1 else x).contiguous()


def sdpa_forward(q, k, v, mask: BlockMask, scale: float):
    g = q.shape[2] // k.shape[2]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q, 1), _bhsd(k, g), _bhsd(v, g), 0.0, mask.kernel_causal(), attn_mask=None, scale=scale
    )
    return out.permute(2, 0, 1, 3), lse.float()


def sdpa_backward(dout, q, k, v, out, lse, mask: BlockMask, scale: float):
    g = q.shape[2] // k.shape[2]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(dout.to(q.dtype), 1), _bhsd(q, 1), _bhsd(k, g), _bhsd(v, g), _bhsd(out.to(q.dtype), 1),
        lse.float().contiguous(), 0.0, mask.kernel_causal(), attn_mask=None, scale=scale,
    )
    b, hq, sk, d = dk.shape

    def fold(x):  # sum the repeated heads back onto their key/value head
        return x.reshape(b, hq // g, g, sk, d).sum(2).permute(2, 0, 1, 3).float()

    return dq.permute(2, 0, 1, 3).float(), fold(dk), fold(dv)
