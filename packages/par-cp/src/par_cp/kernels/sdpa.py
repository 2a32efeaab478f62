"""torch's fused attention kernels behind SDPA, called so that they also return the LSE.

On the CPU its fused CPU kernel (any float dtype); on CUDA torch's own flash kernel (fp16/bf16,
head_dim <= 256), the fast path when the flash-attn package is not installed. Either fits a
block with one document and either no causal mask or a square diagonal block (so top-left and
bottom-right causal alignment agree). GQA is handled by repeating key/value heads.
"""

from __future__ import annotations

import torch

from .mask import BlockMask


def sdpa_fits(q: torch.Tensor, mask: BlockMask) -> bool:
    if q.device.type == "cpu":
        if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    elif q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16) or q.shape[-1] > 256:
        return False
    if mask.doc_pairs() != [(0, mask.q_len, 0, mask.k_len)]:
        return False
    return not mask.kernel_causal() or mask.q_len == mask.k_len


def _bhsd(x: torch.Tensor, repeat: int) -> torch.Tensor:
    x = x.permute(1, 2, 0, 3)
    return (x.repeat_interleave(repeat, dim=1) if repeat > 1 else x).contiguous()


def sdpa_forward(q, k, v, mask: BlockMask, scale: float):
    g = q.shape[2] // k.shape[2]
    args = (_bhsd(q, 1), _bhsd(k, g), _bhsd(v, g), 0.0, mask.kernel_causal())
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(*args, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, attn_mask=None, scale=scale)
    return out.permute(2, 0, 1, 3), lse.float()


def sdpa_backward(dout, q, k, v, out, lse, mask: BlockMask, scale: float):
    g = q.shape[2] // k.shape[2]
    tensors = (_bhsd(dout.to(q.dtype), 1), _bhsd(q, 1), _bhsd(k, g), _bhsd(v, g), _bhsd(out.to(q.dtype), 1),
               lse.float().contiguous())
    if q.is_cuda:  # no dropout: the rng state arguments are unused placeholders
        sq, sk, none = q.shape[0], k.shape[0], torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            *tensors, None, None, sq, sk, 0.0, mask.kernel_causal(), none, none, scale=scale)
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *tensors, 0.0, mask.kernel_causal(), attn_mask=None, scale=scale)
    b, hq, sk, d = dk.shape

    def fold(x):  # sum the repeated heads back onto their key/value head
        return x.reshape(b, hq // g, g, sk, d).sum(2).permute(2, 0, 1, 3).float()

    return dq.permute(2, 0, 1, 3).float(), fold(dk), fold(dv)
