"""Hidden dropout (Megatron's ``--hidden-dropout``) whose mask is a function of where an element is in the
global batch, not of the rank holding it: every layout it runs with trains as one rank would.

An element's keep/drop is a hash of (``[train].seed``, step, its global sample index, token position,
channel, layer, site): no RNG state, so micro-batching, data parallelism and recomputation (which
re-runs a block's forward in its backward) draw the same mask. The trainer says, before each
micro-batch's forward, which step and which global samples it holds (:func:`set_position`).
"""

from __future__ import annotations

import threading

import torch

MASK32 = 0xFFFFFFFF
_where = threading.local()  # (seed, step, first global sample) of the micro-batch being computed


def set_position(seed: int, step: int, first_sample: int) -> None:
    """The micro-batch about to run: its step and the global index of its first sample."""
    _where.position = (seed, step, first_sample)


def position() -> tuple[int, int, int]:
    return getattr(_where, "position", (0, 0, 0))


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def keep_mask(shape: tuple[int, int, int], p: float, where: tuple[int, int, int], layer: int, site: int,
              device: torch.device) -> torch.Tensor:
    """Keep (True) / drop of a ``[S, B, H]`` activation (sequence-first) of one micro-batch."""
    seed, step, first = where
    s_len, b_len, h_len = shape
    s = torch.arange(s_len, device=device, dtype=torch.int64).view(-1, 1, 1)
    b = torch.arange(first, first + b_len, device=device, dtype=torch.int64).view(1, -1, 1)
    h = torch.arange(h_len, device=device, dtype=torch.int64).view(1, 1, -1)
    salt = torch.tensor([seed, step, layer, site], dtype=torch.int64)
    key = 0
    for part in salt.tolist():  # the run, step, layer and site in one 32-bit key
        key = int(_fmix32(torch.tensor((key * 31 + part) & MASK32)).item())
    coords = [b & MASK32, (b >> 32) & MASK32, s, h]
    acc = torch.full((), key, dtype=torch.int64, device=device)
    for c in coords:
        acc = _fmix32((acc * 0x9E3779B1 + c) & MASK32)
    return acc.to(torch.float64) >= p * 4294967296.0


def hidden_dropout(out: torch.Tensor, p: float, where: tuple[int, int, int], layer: int, site: int) -> torch.Tensor:
    """``out`` with elements dropped and the rest scaled by 1 / (1 - p), as ``torch.nn.functional.dropout``."""
    keep = keep_mask(tuple(out.shape), p, where, layer, site, out.device)
    return out * keep.to(out.dtype) * (1.0 / (1.0 - p))
