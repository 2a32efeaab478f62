"""The FLOPs of a Gated DeltaNet layer's core (the family's declaration for ``plan`` and MFU): the chunked
delta rule's matmuls as ``par_cp.delta_rule`` runs them, per value head, on runs of whole chunks of ``C``
tokens (``C = min(CHUNK, seq_len)``). Forward, per chunk: ``beta K K^T`` (``C^2 dk`` multiply-adds), the
unit-lower inverse by ``L`` squarings (two ``C^3`` products each, ``L = log2(C) - 1``), ``U`` and ``W``
(``C^2 dv``, ``C^2 dk``), the queries' scores (``C^2 dk``), and against the carried state: ``W S``, ``Q S``,
``K^T V_new`` (``C dk dv`` each) and the scores times ``V_new`` (``C^2 dv``); backward twice that. Linear in
``seq_len``, unlike softmax attention. The in/out projections and the short conv (its weights are
``conv_kernel`` multiply-adds per channel and token) are counted from the shapes, as every weight is.
flash-linear-attention's kernel inverts by a triangular solve, fewer FLOPs than the squarings: on CUDA with
it installed the figure is the plain path's."""

from __future__ import annotations


def rule_forward_flops(key_dim: int, value_dim: int, chunk: int) -> float:
    """Forward FLOPs (2 per multiply-add) of the chunked rule per value head and token."""
    squarings = max(chunk - 1, 1).bit_length() - 1
    per_chunk = 2 * chunk * chunk * (3 * key_dim + 2 * value_dim) + 4 * squarings * chunk ** 3 + 6 * chunk * key_dim * value_dim
    return per_chunk / chunk


def linear_core_flops(m, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one Gated DeltaNet layer's rule, all its value heads."""
    from par_cp.delta_rule import CHUNK

    return 3.0 * m.linear_value_heads * rule_forward_flops(m.linear_key_dim, m.linear_value_dim, min(CHUNK, seq_len))
