"""Attention kernels behind one interface: ``(q, k, v, BlockMask, scale) -> (out, lse)``.

Tensors are sequence-first: q ``[Sq, B, Hq, D]``, k/v ``[Sk, B, Hkv, D]``; ``out`` comes back
fp32 ``[Sq, B, Hq, D]`` and ``lse`` fp32 ``[B, Hq, Sq]``. Backends:

- ``torch``: pure-PyTorch blockwise online softmax, any mask, any dtype, any device (the CPU path);
- ``sdpa``: torch's fused CPU attention where the block fits it;
- ``flash``: flash-attn varlen on CUDA (fp16/bf16) when importable.

``auto`` takes flash, then sdpa, then torch, per block, whichever fits first.
"""

from __future__ import annotations

import torch

from .blockwise import blockwise_backward, blockwise_forward
from .flash import flash_available, flash_backward, flash_fits, flash_forward
from .mask import BlockMask
from .sdpa import sdpa_backward, sdpa_fits, sdpa_forward

BACKENDS = ("auto", "torch", "sdpa", "flash")

__all__ = ["BACKENDS", "BlockMask", "block_backward", "block_forward", "choose_kernel", "flash_available", "merge_partial", "merge_partial_"]


def choose_kernel(backend: str, q: torch.Tensor, mask: BlockMask) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend in ("auto", "flash") and flash_fits(q, mask):
        return "flash"
    if backend in ("auto", "sdpa") and sdpa_fits(q, mask):
        return "sdpa"
    return "torch"


_FORWARD = {"torch": blockwise_forward, "sdpa": sdpa_forward, "flash": flash_forward}
_BACKWARD = {"torch": blockwise_backward, "sdpa": sdpa_backward, "flash": flash_backward}


def block_forward(q, k, v, mask: BlockMask, scale: float, backend: str = "auto"):
    """Attention of one block: fp32 output and LSE."""
    out, lse = _FORWARD[choose_kernel(backend, q, mask)](q, k, v, mask, scale)
    return out.float(), lse


def block_backward(dout, q, k, v, out, lse, mask: BlockMask, scale: float, backend: str = "auto"):
    """This block's share of (dq, dk, dv), fp32, given the final merged ``out`` and ``lse``."""
    return _BACKWARD[choose_kernel(backend, q, mask)](dout, q, k, v, out, lse, mask, scale)


def merge_partial_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """The online-softmax merge of :func:`merge_partial`, into ``out`` and ``lse`` in place (views
    of the accumulators): two passes over ``out`` instead of four (scale, then a fused
    multiply-add; no new tensor to copy back)."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = new_lse.clamp(min=-1e30)  # rows no key reached yet: exp(-inf - safe) = 0, not nan
    out.mul_(torch.exp(lse - safe).permute(2, 0, 1).unsqueeze(-1))  # [B, H, S] -> [S, B, H, 1]
    out.addcmul_(torch.exp(block_lse - safe).permute(2, 0, 1).unsqueeze(-1), block_out)
    lse.copy_(new_lse)


def merge_partial(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Online-softmax merge of two partial results over disjoint keys (fp32):
    lse = log(e^lse_a + e^lse_b), out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b."""
    if out is None:
        return block_out, block_lse
    out, lse = out.clone(), lse.clone()
    merge_partial_(out, lse, block_out, block_lse)
    return out, lse
