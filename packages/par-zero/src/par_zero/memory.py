"""Model-state bytes per rank for every strategy and HSDP: the explainer's formulas, no process group.

With P, G, O the parameter, gradient and optimizer-state bytes of the model partition and
``d`` the sharding-group size (for HSDP the inner group size ``h``):

    no_shard (DDP)          P + G + O
    optim (ZeRO-1)          P + G + O/d
    optim_grads (ZeRO-2)    P + (G + O)/d
    optim_grads_params (3)  (P + G + O)/d
    HSDP, outer no_shard    the inner strategy's formula with d = h (1/h of DDP for ZeRO-3)
    HSDP, outer 'optim'     P/h + (G + O)/(h * outer)   (grads and optimizer also split over replicas)

These are idealised model-state figures (no activations, no transient gather/reduce buffers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import DataParallelConfig


@dataclass(frozen=True)
class ModelState:
    """Bytes of parameters, gradients and optimizer state held by one rank."""

    params: float
    grads: float
    optim: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optim


def model_state(P: float, G: float, O: float, strategy: str, d: int, *, outer: int = 1, outer_strategy: str = "no_shard") -> ModelState:
    """Per-rank model state for ``strategy`` sharded over ``d`` ranks (HSDP: d = inner size, ``outer`` replicas)."""
    cfg = DataParallelConfig(strategy=strategy, outer_strategy=outer_strategy)  # validates the names
    if d < 1 or outer < 1:
        raise ValueError(f"d={d} and outer={outer} must be >= 1")
    if outer > 1:
        cfg.check_outer(True)
    split = d * outer if cfg.outer_shard_optimizer else d  # grads and optimizer state (ZeRO-3 with outer 'optim')
    return ModelState(P / d if cfg.shard_params else P, G / split if cfg.shard_grads else G,
                      O / split if cfg.shard_optimizer else O)


def bytes_per_param(param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype | None = None,
                    state_bytes: int = 8) -> tuple[int, int, int]:
    """(P, G, O) bytes per parameter in this package: grads in reduce_dtype or param_dtype, the optimizer's
    ``state_bytes`` (its declaration's :meth:`~par_zero.Declaration.state_bytes`; AdamW's two fp32 moments: 8),
    plus an fp32 master copy when params are not fp32."""
    p = torch.finfo(param_dtype).bits // 8
    g = torch.finfo(reduce_dtype or param_dtype).bits // 8
    o = state_bytes + (0 if param_dtype == torch.float32 else 4)
    return p, g, o


def model_state_for_params(
    num_params: int,
    strategy: str,
    d: int,
    *,
    outer: int = 1,
    outer_strategy: str = "no_shard",
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype | None = None,
) -> ModelState:
    """Per-rank model state of ``num_params`` parameters trained by :class:`DataParallel`."""
    p, g, o = bytes_per_param(param_dtype, reduce_dtype)
    return model_state(num_params * p, num_params * g, num_params * o, strategy, d, outer=outer, outer_strategy=outer_strategy)
