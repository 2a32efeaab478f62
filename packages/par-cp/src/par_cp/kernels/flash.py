"""flash-attn (varlen) on CUDA: one call per block, documents as variable-length sequences.

Only used when ``flash_attn`` imports and the tensors are on CUDA (optional ``gpu`` extra). The
block's document pieces become the varlen sequences; queries that see no key are left out of
the call and get output 0 and LSE -inf. The private ``_flash_attn_varlen_forward/backward``
entry points are used because only they return the LSE and accept the final output and LSE
in backward; their keyword names differ across versions, so arguments are matched by name.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .mask import BlockMask


@functools.lru_cache(maxsize=1)
def _flash():
    try:
        from flash_attn import flash_attn_interface as fai
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return fai


def flash_available() -> bool:
    return torch.cuda.is_available() and _flash() is not None


def flash_fits(q: torch.Tensor, mask: BlockMask) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and mask.aligned() and _flash() is not None


def _call(fn, **kwargs):
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # wrapped as a torch custom op in newer flash-attn
        params = inspect.signature(fn._init_fn).parameters
    if "window_size" in params:
        kwargs["window_size"] = (-1, -1)
    else:
        kwargs.setdefault("window_size_left", -1)
        kwargs.setdefault("window_size_right", -1)
    defaults = {"softcap": 0.0, "alibi_slopes": None, "return_softmax": False, "deterministic": False, "rng_state": None}
    for name, value in defaults.items():
        kwargs.setdefault(name, value)
    return fn(**{n: v for n, v in kwargs.items() if n in params})


def _varlen_index(mask: BlockMask, batch: int, device):
    """Token indices (batch-major) of the queries and keys in each document piece, and cu_seqlens."""
    pairs = mask.doc_pairs()
    q_idx, k_idx, cu_q, cu_k = [], [], [0], [0]
    for b in range(batch):
        for q0, q1, k0, k1 in pairs:
            q_idx.append(torch.arange(q0, q1) + b * mask.q_len)
            k_idx.append(torch.arange(k0, k1) + b * mask.k_len)
            cu_q.append(cu_q[-1] + q1 - q0)
            cu_k.append(cu_k[-1] + k1 - k0)
    max_q = max(q1 - q0 for q0, q1, _, _ in pairs)
    max_k = max(k1 - k0 for _, _, k0, k1 in pairs)
    cu = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q_idx, k_idx, cu_q, cu_k = (_to_device(t, device) for t in (torch.cat(q_idx), torch.cat(k_idx), cu(cu_q), cu(cu_k)))
    return q_idx, k_idx, cu_q, cu_k, max_q, max_k


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``; to a GPU through pinned memory, not waiting for its stream (a
    plain host copy would, four times per attention block)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _flat(x):  # [S, B, H, D] -> [B*S, H, D]
    return x.transpose(0, 1).reshape(-1, x.shape[2], x.shape[3])


def flash_forward(q, k, v, mask: BlockMask, scale: float):
    sq, b, hq, d = q.shape
    qi, ki, cu_q, cu_k, max_q, max_k = _varlen_index(mask, b, q.device)
    res = _call(
        _flash()._flash_attn_varlen_forward,
        q=_flat(q)[qi].contiguous(), k=_flat(k)[ki].contiguous(), v=_flat(v)[ki].contiguous(),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        dropout_p=0.0, softmax_scale=scale, causal=mask.kernel_causal(),
    )
    o, lse = res[0], res[1]  # o [Nq, Hq, D], lse [Hq, Nq]
    out = torch.zeros(b * sq, hq, d, device=q.device, dtype=torch.float32)
    out[qi] = o.float()
    full_lse = torch.full((hq, b * sq), float("-inf"), device=q.device)
    full_lse[:, qi] = lse.float()
    return out.reshape(b, sq, hq, d).transpose(0, 1), full_lse.reshape(hq, b, sq).transpose(0, 1)


def flash_backward(dout, q, k, v, out, lse, mask: BlockMask, scale: float):
    sq, b, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[2]
    qi, ki, cu_q, cu_k, max_q, max_k = _varlen_index(mask, b, q.device)
    qs, ks, vs = _flat(q)[qi].contiguous(), _flat(k)[ki].contiguous(), _flat(v)[ki].contiguous()
    dq, dk, dv = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
    lse_sel = lse.transpose(0, 1).reshape(hq, b * sq)[:, qi].float().contiguous()
    _call(
        _flash()._flash_attn_varlen_backward,
        dout=_flat(dout.to(q.dtype))[qi].contiguous(), q=qs, k=ks, v=vs, out=_flat(out.to(q.dtype))[qi].contiguous(),
        softmax_lse=lse_sel, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0, softmax_scale=scale, causal=mask.kernel_causal(),
    )
    full_dq = torch.zeros(b * sq, hq, d, device=q.device)
    full_dk = torch.zeros(b * sk, hkv, d, device=q.device)
    full_dv = torch.zeros_like(full_dk)
    full_dq[qi] = dq.float()
    full_dk.index_add_(0, ki, dk.float())
    full_dv.index_add_(0, ki, dv.float())
    unflat = lambda x, s: x.reshape(b, s, x.shape[1], d).transpose(0, 1)  # noqa: E731
    return unflat(full_dq, sq), unflat(full_dk, sk), unflat(full_dv, sk)
