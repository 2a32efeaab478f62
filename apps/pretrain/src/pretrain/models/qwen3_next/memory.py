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
``conv_kernel`` shifted inputs and its output (before SiLU) over its channels, the 4 value-wide tensors
of the output side in the compute dtype (``z``'s contiguous copy, ``silu(z)``, the norm's output, the
gate's product ``out_proj`` reads), the write strengths (``sigmoid(b)``); in fp32 the L2 norms' inputs
and inverse norms of q and k, the decay's two scalars and the norm's scale per value head, the norm's
input and normalised value; and the conv's ``conv_kernel`` int64 gather indices per position (shared by
the micro-batch's sequences). With flash-linear-attention on CUDA the rule saves less (its kernel
recomputes the chunk states): the plan is then an upper bound.

Under ``[model].recompute``'s ``core_attn`` (``selective``) the conv, the gates and the rule run in a
checkpoint (``gdn.py``: ``_core``), which keeps its inputs and none of their saved set: q, k and v are
views of ``in_proj_qkvz``'s output, so its whole storage stays (``2 nk dk + 2 nv dv``, ``z`` with it),
and ``beta`` and ``a`` keep ``in_proj_ba``'s (``2 nv``); the projections' input and the output side
(the norm, the gate, ``out_proj``'s input) run outside and keep what they keep without it. The backward
reruns the core: its saved set comes back for that layer's backward (:func:`gdn_rerun_per_token`),
beside the backward's working set (:func:`gdn_backward_work_per_token`).
``layernorm``, ``mlp``, ``moe`` and ``moe_act`` leave the layer as it is (its input is the input norm's
output either way); ``full`` keeps the decoder layer's input only, and its rerun keeps the whole set
(the core is not checkpointed again inside a recomputed layer).
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


def kept_per_token(m, tp: int, pb: int, core_recomputed: bool) -> float:
    """Bytes the layer keeps per token outside the conv and the rule (module docstring): the projections'
    input and the output side; without ``core_attn`` the gates' and L2 norms' saved values, with it the
    checkpoint's inputs (``in_proj_qkvz``'s and ``in_proj_ba``'s outputs)."""
    nk, nv, dk, dv = m.linear_key_heads / tp, m.linear_value_heads / tp, m.linear_key_dim, m.linear_value_dim
    outside = pb * (m.hidden + 4 * nv * dv) + 4 * (nv + 2 * nv * dv)
    if core_recomputed:
        return outside + pb * (2 * nk * dk + 2 * nv * dv + 2 * nv)
    return outside + pb * nv + 4 * (2 * nk * dk + 2 * nk + 2 * nv)


def gdn_saved_per_token(m, tp: int, cp: int, pb: int, micro_batch: int, recompute: str = "none",
                        chunk: int = CHUNK) -> float:
    """Bytes one Gated DeltaNet layer saves per token of this rank (module docstring), its pieces of
    whole chunks (``CHUNK`` tokens); ``recompute``: ``none``, or ``selective`` (its core recomputed)."""
    if recompute == "selective":
        return kept_per_token(m, tp, pb, True)
    core = scan_saved_per_token(m, tp, cp, chunk) + conv_saved_per_token(m, tp, pb, micro_batch)
    return core + kept_per_token(m, tp, pb, False)


def gdn_rerun_per_token(m, tp: int, cp: int, pb: int, micro_batch: int, chunk: int = CHUNK) -> float:
    """Bytes a recomputed core brings back per token for its layer's backward: the saved set without
    recomputation less the checkpoint's."""
    return (gdn_saved_per_token(m, tp, cp, pb, micro_batch, "none", chunk)
            - gdn_saved_per_token(m, tp, cp, pb, micro_batch, "selective", chunk))


def gdn_backward_work_per_token(m, tp: int, pb: int, chunk: int = CHUNK) -> float:
    """Bytes a linear layer's backward holds per token beyond its saved set, at most: its input's gradient
    (``hidden``, the compute dtype) and, per value head in fp32, 4 key widths (the rule's gradients of q
    and k, before and after the repeat over a key head's value heads) and 2 chunk-square rows (the chunk
    loop's and the inverse's gradients). A bound: the peak moves between the chunk loop and the inverse's
    backward with the key and value widths, and the saved tensors freed by then vary with it."""
    return pb * m.hidden + 4 * m.linear_value_heads / tp * (4 * m.linear_key_dim + 2 * chunk)
