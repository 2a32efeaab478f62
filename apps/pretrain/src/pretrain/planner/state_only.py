"""`pretrain plan --params N --dp D`: model state per rank of N parameters, no config.

P, G, O = N x the bytes per parameter of the parameters, gradients and optimizer state (default:
the trainer's convention, 2 + 4 + 12), sharded by par-zero's formulas (:func:`par_zero.model_state`)
for every ZeRO strategy and, with ``hsdp_replicas`` N, HSDP: ZeRO-3 inside h = D / N ranks,
replicated N times, 1/h of DDP. Each row also gives its fraction of the DDP baseline, P + G + O.
"""

from __future__ import annotations

import torch

from par_zero import bytes_per_param, model_state

from ..sizing.state import STRATEGIES

TRAINER_BYTES = bytes_per_param(torch.bfloat16, torch.float32)  # (2, 4, 12)
TRAINER = "bf16 params, fp32 grads, fp32 main weights + Adam moments: 2 + 4 + 12 bytes per parameter"


def params_only_plan(num_params: float, dp: int, bytes_pgo: tuple = TRAINER_BYTES,
                     hsdp_replicas: int | None = None) -> dict:
    """Model state of ``num_params`` parameters at data-parallel size ``dp`` for every strategy
    (and HSDP with ``hsdp_replicas`` replicas), with ``bytes_pgo`` = (P, G, O) bytes per parameter."""
    P, G, O = (num_params * b for b in bytes_pgo)
    rows = {s: (label, model_state(P, G, O, s, dp)) for label, s in STRATEGIES}
    if hsdp_replicas is not None:
        h = dp // hsdp_replicas
        rows["hsdp"] = (f"HSDP {hsdp_replicas}x{h}", model_state(P, G, O, "optim_grads_params", h, outer=hsdp_replicas))
    baseline = P + G + O
    detail = {k: {"label": label, "params": st.params, "grads": st.grads, "optim": st.optim, "total": st.total,
                  "fraction": st.total / baseline} for k, (label, st) in rows.items()}
    p, g, o = bytes_pgo
    convention = TRAINER if tuple(bytes_pgo) == TRAINER_BYTES else (
        f"params, grads, optimizer state: {p:g} + {g:g} + {o:g} bytes per parameter")
    return {"params": num_params, "dp": dp, "convention": convention,
            "bytes_per_param": {"params": p, "grads": g, "optim": o}, "hsdp_replicas": hsdp_replicas,
            "model_state_gb": {k: v["total"] / 1e9 for k, v in detail.items()}, "detail": detail}
