"""Hidden and attention dropout (Megatron's ``--hidden-dropout``, ``--attention-dropout``) whose mask is a function of where an element is in the
global batch, not of the rank holding it: every layout it runs with trains as one rank would.

An element's keep/drop is a hash of (``[train].seed``, step, its global sample index, token position,
channel (attention: head, query and key positions), layer, site): no RNG state, so micro-batching, data parallelism and recomputation (which
re-runs a block's forward in its backward) draw the same mask. The trainer says, before each
micro-batch's forward, which step and which global samples it holds (:class:`DropoutPosition`).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


class DropoutPosition:
    """(seed, step, first global sample) of the micro-batch a rank's model computes: one per model (its
    ``ChunkContext``), set by the trainer before each micro-batch's forward, read by the layers that drop."""

    def __init__(self) -> None:
        self.at: tuple[int, int, int] = (0, 0, 0)

    def set(self, seed: int, step: int, first_sample: int) -> None:
        """The micro-batch about to run: its step and the global index of its first sample."""
        self.at = (seed, step, first_sample)


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser on a Python int or int64 tensor holding values in [0, 2**32) (each
    product is masked at once, so a tensor's int64 wrap never reaches the bits kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def _keep(coords: list[torch.Tensor], p: float, where: tuple[int, int, int], layer: int, site: int,
          device: torch.device) -> torch.Tensor:
    """Keep (True) / drop of the elements whose coordinates broadcast from ``coords`` (the sample first)."""
    seed, step, _first = where
    key = 0
    for part in (seed, step, layer, site):  # the run, step, layer and site in one 32-bit key
        key = _fmix32((key * 31 + part) & MASK32)  # plain ints: no tensor, no host read
    sample = coords[0]
    acc = torch.full((), key, dtype=torch.int64, device=device)
    for c in [sample & MASK32, (sample >> 32) & MASK32, *coords[1:]]:
        acc = _fmix32((acc * 0x9E3779B1 + c) & MASK32)
    return acc.to(torch.float64) >= p * 4294967296.0


def _arange(n: int, device, dims: int, at: int, start: int = 0) -> torch.Tensor:
    shape = [1] * dims
    shape[at] = n
    return torch.arange(start, start + n, device=device, dtype=torch.int64).view(shape)


def keep_mask(shape: tuple[int, int, int], p: float, where: tuple[int, int, int], layer: int, site: int,
              device: torch.device) -> torch.Tensor:
    """Keep (True) / drop of a ``[S, B, H]`` activation (sequence-first) of one micro-batch."""
    s_len, b_len, h_len = shape
    coords = [_arange(b_len, device, 3, 1, where[2]), _arange(s_len, device, 3, 0), _arange(h_len, device, 3, 2)]
    return _keep(coords, p, where, layer, site, device)


def hidden_dropout(out: torch.Tensor, p: float, where: tuple[int, int, int], layer: int, site: int) -> torch.Tensor:
    """``out`` with elements dropped and the rest scaled by 1 / (1 - p), as ``torch.nn.functional.dropout``."""
    keep = keep_mask(tuple(out.shape), p, where, layer, site, out.device)
    return out * keep.to(out.dtype) * (1.0 / (1.0 - p))


ATTENTION_SITE = 2


def attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, p: float,
                           where: tuple[int, int, int], layer: int) -> torch.Tensor:
    """Causal attention of ``q [S, B, Hq, D]``, ``k, v [S, B, Hkv, D]`` with its probabilities dropped per
    (sample, head, query, key), written out (the fused kernels draw their own masks); ``[S, B, Hq, D]``."""
    s_len, b_len, heads, _ = q.shape
    rep = heads // k.shape[2]
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    scores = (qh.float() @ kh.float().transpose(-1, -2)) * scale
    causal = torch.ones(s_len, s_len, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    dims = 4
    coords = [_arange(b_len, q.device, dims, 0, where[2]), _arange(heads, q.device, dims, 1),
              _arange(s_len, q.device, dims, 2), _arange(s_len, q.device, dims, 3)]
    keep = _keep(coords, p, where, layer, ATTENTION_SITE, q.device)
    probs = probs * keep.to(probs.dtype) * (1.0 / (1.0 - p))
    return (probs.to(vh.dtype) @ vh).permute(2, 0, 1, 3)
