"""Which keys each query may see, for one (query range, key range) block of the global sequence.

Every block the CP modes hand to a kernel is a contiguous range of query positions against a
contiguous range of key positions (global token indices of the full sequence). The mask is
then fully described by: causal or not, and the document boundaries (``cu_seqlens`` of the
full sequence; attention never crosses a document). Kernels with fixed mask shapes (SDPA,
flash-attn) check ``aligned`` to see whether they can run the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockMask:
    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    docs: tuple[int, ...] | None = None  # cu_seqlens of the full sequence, or None: one document

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start

    @property
    def k_len(self) -> int:
        return self.k_end - self.k_start

    def is_empty(self) -> bool:
        """True when no query sees any key: the block can be skipped."""
        if self.q_len <= 0 or self.k_len <= 0:
            return True
        if self.causal and self.k_start >= self.q_end:
            return True
        return not self.doc_pairs()

    def clipped(self) -> "BlockMask":
        """The same block with the key range narrowed to keys some query can see
        (causal: none after the last query; documents: none outside the queries' documents)."""
        k0, k1 = self.k_start, self.k_end
        if self.causal:
            k1 = min(k1, self.q_end)
        if self.docs is not None and self.q_len > 0:
            import bisect

            first = bisect.bisect_right(self.docs, self.q_start) - 1
            last = bisect.bisect_right(self.docs, self.q_end - 1)
            k0 = max(k0, self.docs[max(first, 0)])
            k1 = min(k1, self.docs[min(last, len(self.docs) - 1)])
        return BlockMask(self.q_start, self.q_end, k0, max(k0, k1), self.causal, self.docs)

    def keys_all_before_queries(self) -> bool:
        return self.k_end <= self.q_start

    def aligned(self) -> bool:
        """Causal blocks that a bottom-right-aligned causal kernel computes exactly: the key range
        ends where the query range ends (diagonal) or before it starts (fully visible)."""
        return not self.causal or self.k_end == self.q_end or self.keys_all_before_queries()

    def kernel_causal(self) -> bool:
        """Whether a fixed-shape kernel must apply its (bottom-right aligned) causal mask."""
        return self.causal and not self.keys_all_before_queries()

    def doc_pairs(self) -> list[tuple[int, int, int, int]]:
        """Per document touching both ranges: (q_lo, q_hi, k_lo, k_hi) relative to the block."""
        bounds = self.docs if self.docs is not None else (min(self.q_start, self.k_start), max(self.q_end, self.k_end))
        out = []
        for d0, d1 in zip(bounds[:-1], bounds[1:]):
            q0, q1 = max(self.q_start, d0), min(self.q_end, d1)
            k0, k1 = max(self.k_start, d0), min(self.k_end, d1)
            if self.causal:
                k1 = min(k1, q1)
            if q1 > q0 and k1 > k0:
                out.append((q0 - self.q_start, q1 - self.q_start, k0 - self.k_start, k1 - self.k_start))
        return out

    def dense(self, k_lo: int = 0, k_hi: int | None = None, device=None) -> torch.Tensor | None:
        """Boolean [q_len, k_hi-k_lo] mask (True = may attend) for keys k_lo..k_hi of the block,
        or None when every query sees every one of those keys."""
        k_hi = self.k_len if k_hi is None else k_hi
        qpos = torch.arange(self.q_start, self.q_end, device=device)
        kpos = torch.arange(self.k_start + k_lo, self.k_start + k_hi, device=device)
        mask = None
        if self.causal and self.k_start + k_hi - 1 > self.q_start:
            mask = kpos[None, :] <= qpos[:, None]
        if self.docs is not None and len(self.docs) > 2:
            bounds = torch.tensor(self.docs, device=device)
            qdoc = torch.searchsorted(bounds, qpos, right=True)
            kdoc = torch.searchsorted(bounds, kpos, right=True)
            same = qdoc[:, None] == kdoc[None, :]
            if not bool(same.all()):
                mask = same if mask is None else mask & same
        return mask
