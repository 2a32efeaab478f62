"""The gated delta rule (Gated DeltaNet's recurrence), chunked, in plain PyTorch (fp32), and its affine form.

Per head, with a state ``S`` of shape ``[dk, dv]`` and per token a query ``q``, key ``k`` (both ``[dk]``),
value ``v`` (``[dv]``), log-decay ``g <= 0`` and write strength ``beta``::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t

The chunked form (the WY / UT transform of DeltaNet) does a chunk of ``C`` tokens in a few matmuls and one
triangular solve, and carries the state from chunk to chunk. Tensors are ``[B, H, T, D]``; queries and keys
come normalised and scaled (the caller's business), so the rule itself has no options.

The rule is affine in its initial state: for a run of tokens, ``S_end = S_local + A S_in`` and
``O = O_local + Q~ S_in``, where ``S_local``/``O_local`` start from zero, ``A`` (``[dk, dk]``) is the run's
transition (its decays and delta-rule projections) and ``Q~`` (``[T, dk]``) the queries as the incoming
state sees them. :func:`affine_delta_rule` computes all four in one chunked pass: the values widened by
``dk`` zero columns and the initial state ``[0 | I]``, so the extra columns carry ``A`` and ``Q~``. Context
parallelism composes the runs of the ranks with them (``state_passing.py``).

On CUDA with flash-linear-attention installed its chunked kernel runs instead (same arguments).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _fla(q):
    """flash-linear-attention's chunked kernel for CUDA tensors where installed, else None."""
    if not q.is_cuda:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional `gpu` extra

        return chunk_gated_delta_rule
    except Exception:  # not installed, or no CUDA build
        return None


def _unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` for a strictly lower-triangular ``L [..., C, C]``: ``L`` is nilpotent, so the inverse is
    ``sum_j (-L)^j = prod_k (I + (-L)^(2^k))``, log2(C) batched matmuls (the CPU's batched triangular solve
    of many small systems is far slower)."""
    n = -lower
    out = torch.eye(lower.shape[-1], device=lower.device, dtype=lower.dtype) + n
    for _ in range(max(lower.shape[-1] - 1, 1).bit_length() - 1):
        n = n @ n
        out = out + out @ n
    return out


def chunked_delta_rule(q, k, v, g, beta, initial_state=None, chunk: int = CHUNK):
    """``(O [B, H, T, dv], S_end [B, H, dk, dv])`` of the gated delta rule (module docstring), fp32.
    ``q, k [B, H, T, dk]``, ``v [B, H, T, dv]``, ``g, beta [B, H, T]``; ``initial_state`` zero when None."""
    if (fla := _fla(q)) is not None:  # its [B, T, H, D] layout; q comes scaled, g is the log decay
        o, s = fla(*(x.transpose(1, 2) for x in (q, k, v, g, beta)), scale=1.0, initial_state=initial_state,
                   output_final_state=True)
        return o.transpose(1, 2).float(), s.float()
    with torch.autocast(q.device.type, enabled=False):  # fp32 throughout: bf16 autocast would round the UT inverse
        return _chunked(q, k, v, g, beta, initial_state, chunk)


def _chunked(q, k, v, g, beta, initial_state, chunk: int):
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    chunk = min(chunk, t)  # a short run: one chunk, unpadded
    pad = (-t) % chunk
    if pad:  # zero keys, g = 0 and beta = 0 leave the state as it is
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    gamma = g.cumsum(-1)  # log decay from the chunk's start through each token
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(later, float("-inf")).exp()  # exp(gamma_i - gamma_j), j <= i
    kb = k * beta[..., None]
    # (I + strictly-lower(beta K K^T * decay)) U = beta V, and the same for the decayed keys (W)
    inverse = _unit_lower_inverse((kb @ k.transpose(-1, -2) * decay).tril(-1))
    u = inverse @ (v * beta[..., None])
    w = inverse @ (kb * gamma.exp()[..., None])
    scores = q @ k.transpose(-1, -2) * decay  # causal, the diagonal included
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    end_decay = gamma[..., -1].exp()[..., None, None]
    s = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s
        out.append(q_decayed[:, :, i] @ s + scores[:, :, i] @ v_new)
        s = s * end_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    return torch.cat(out, dim=2)[:, :, :t], s


def affine_delta_rule(q, k, v, g, beta, chunk: int = CHUNK):
    """``(O_local, Q~, S_local, A)`` of a run of tokens (module docstring): ``O = O_local + Q~ S_in`` and
    ``S_end = S_local + A S_in`` for any incoming state ``S_in``. Shapes ``[B, H, T, dv]``, ``[B, H, T, dk]``,
    ``[B, H, dk, dv]``, ``[B, H, dk, dk]``."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    wide = torch.cat([v.float(), v.new_zeros(b, h, t, dk, dtype=torch.float32)], -1)
    eye = torch.eye(dk, device=k.device).expand(b, h, dk, dk)
    start = torch.cat([k.new_zeros(b, h, dk, dv, dtype=torch.float32), eye], -1)
    o, s = chunked_delta_rule(q, k, wide, g, beta, start, chunk)
    return o[..., :dv], o[..., dv:], s[..., :dv], s[..., dv:]


def recurrent_delta_rule(q, k, v, g, beta, initial_state=None):
    """The rule token by token (the module docstring's two lines; the tests' reference)."""
    b, h, t, dk = k.shape
    s = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state
    out = []
    for i in range(t):
        kt, bt = k[:, :, i], beta[:, :, i, None]
        s = g[:, :, i, None, None].exp() * (s - kt[..., :, None] * (bt * (kt[..., None, :] @ s).squeeze(-2))[..., None, :])
        s = s + kt[..., :, None] * (bt * v[:, :, i])[..., None, :]
        out.append((q[:, :, i, None, :] @ s).squeeze(-2))
    return torch.stack(out, 2), s
