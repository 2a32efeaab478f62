"""What a Gated DeltaNet layer keeps for backward, per token, as ``gdn.py`` and par-cp's chunked rule
(``par_cp.delta_rule``, the plain-PyTorch path) save it: the family's declaration for ``plan``.

The chunked rule keeps, per value head and token (fp32): ``2 L + 6`` chunk-square rows (the decays,
``beta K K^T``, the queries' scores twice, and the ``L + 1`` powers and ``L + 1`` partial products of the
unit-lower inverse, ``L = log2(chunk) - 1`` squarings), 11 key widths (q, k, their decayed and
beta-weighted copies, the WY keys, and the copies the batched matmuls make of the layer's head-major
views of q and k), 3 value widths (the values, ``U`` and each chunk's new values), the
chunk states (one ``[dk, V]`` state per chunk: ``dk V / chunk`` per token) and 4 scalars, on runs of
more than one chunk. Under context parallelism a piece that a state enters runs the affine form: its
values are widened by ``dk`` zero columns (``V = dv + dk``), and it keeps one more key width (the
incoming state's queries ``Q~``); its transition and incoming state are per piece
(``Qwen3Next.recurrent_state``).

The rest of the layer, per token: the projections' input (``hidden``, the compute dtype), the conv's
``conv_kernel`` shifted inputs and its output (before SiLU) over its channels, the 4 value-wide
tensors of the output side (the rule's output in the compute dtype, ``z``, the gate's product, the
norm's output), the write strengths (``sigmoid(b)``); in fp32 the L2 norms' inputs and inverse norms of q and k, the decay's
two scalars and the norm's scale per value head, the norm's input and normalised value; and the conv's
``conv_kernel`` int64 gather indices per position (shared by the micro-batch's sequences). With flash-linear-attention on CUDA the rule saves less (its
kernel recomputes the chunk states): the plan is then an upper bound.
"""

from __future__ import annotations

from par_cp.delta_rule import CHUNK


def rule_per_token(key_dim: int, value_width: int, chunk: int = CHUNK) -> float:
    """fp32 values the chunked rule saves per value head and token (module docstring), on runs of
    whole chunks."""
    squarings = max(chunk - 1, 1).bit_length() - 1
    return (2 * squarings + 6) * chunk + 11 * key_dim + 3 * value_width + key_dim * value_width / chunk + 4


def conv_channels(m, tp: int) -> int:
    """The short conv's channels on one tp rank: queries, keys and values of its key heads."""
    return (2 * m.linear_key_heads * m.linear_key_dim + m.linear_value_heads * m.linear_value_dim) // tp


def scan_saved_per_token(m, tp: int, cp: int, chunk: int = CHUNK) -> float:
    """Bytes the chunked rule saves per token of this rank (its pieces of whole chunks): fp32, per value
    head; under context parallelism the affine form's widened values and one more key width."""
    affine = cp > 1
    width = m.linear_value_dim + (m.linear_key_dim if affine else 0)
    extra = m.linear_key_dim if affine else 0
    return m.linear_value_heads / tp * 4 * (rule_per_token(m.linear_key_dim, width, chunk) + extra)


def conv_saved_per_token(m, tp: int, pb: int, micro_batch: int) -> float:
    """Bytes the short conv saves per token: its ``conv_kernel`` shifted inputs and its output, and its
    int64 gather indices per position."""
    return (m.conv_kernel + 1) * conv_channels(m, tp) * pb + 8 * m.conv_kernel / micro_batch


def gdn_saved_per_token(m, tp: int, cp: int, pb: int, micro_batch: int, chunk: int = CHUNK) -> float:
    """Bytes one Gated DeltaNet layer saves per token of this rank (module docstring), its pieces of
    whole chunks (``CHUNK`` tokens)."""
    nk, nv, dk, dv = m.linear_key_heads / tp, m.linear_value_heads / tp, m.linear_key_dim, m.linear_value_dim
    layer = pb * (m.hidden + 4 * nv * dv + nv) + 4 * (2 * nk * dk + 2 * nk + 3 * nv + 2 * nv * dv)
    return scan_saved_per_token(m, tp, cp, chunk) + conv_saved_per_token(m, tp, pb, micro_batch) + layer
