"""Model-state bytes of one rank: par-zero's convention and memory model on the rank's parameters.

The trainer's mixed precision (Megatron's): bf16 parameters for compute (fp32 runs: fp32),
gradients accumulated and reduced in ``[train].grad_reduce_dtype`` and, in the optimizer, fp32
main weights (bf16 runs only) and two fp32 Adam moments: :func:`par_zero.bytes_per_param`. They are
sharded as the ZeRO strategy says (:func:`par_zero.model_state`): dense parameters over dp x cp,
routed experts over expert dp; with HSDP, ZeRO-3 inside each replica.
"""

from __future__ import annotations

import torch

from par_zero import ModelState, bytes_per_param, model_state

from .params import rank_params

STRATEGIES = (("DDP", "no_shard"), ("ZeRO-1", "optim"), ("ZeRO-2", "optim_grads"), ("ZeRO-3", "optim_grads_params"))


def state_dtypes(train, device_type: str = "cuda") -> tuple[torch.dtype, torch.dtype]:
    """(parameter dtype, gradient-reduction dtype) of ``[train]`` on ``device_type``."""
    bf16 = train.resolved_dtype(device_type) == "bf16"
    param = torch.bfloat16 if bf16 else torch.float32
    return param, torch.bfloat16 if bf16 and train.grad_reduce_dtype == "bf16" else torch.float32


def convention(train, device_type: str = "cuda") -> str:
    """The bytes per parameter in words, for the plan's output."""
    p, g, o = bytes_per_param(*state_dtypes(train, device_type))
    main = " + fp32 main weights" if o > 8 else ""
    return f"{8 * p}-bit params, {8 * g}-bit grads, fp32 Adam moments{main}: {p} + {g} + {o} bytes per parameter"


def params_state(dense: float, experts: float, d: int, ed: int, zero: str, dtypes, replicas: int = 1) -> ModelState:
    """Bytes of ``dense`` elements sharded over ``d`` ranks and ``experts`` over ``ed``; ``replicas`` > 1:
    HSDP (ZeRO-3 inside ``d / replicas`` ranks, replicated across the replicas)."""
    p, g, o = bytes_per_param(*dtypes)
    zero = "optim_grads_params" if zero == "torch_fsdp2" else zero  # torch's FSDP2 shards as ZeRO-3
    parts = []
    for n, size in ((dense, d), (experts, ed)):
        if replicas > 1:
            parts.append(model_state(n * p, n * g, n * o, "optim_grads_params", max(size // replicas, 1), outer=replicas))
        else:
            parts.append(model_state(n * p, n * g, n * o, zero, size))
    return ModelState(*(sum(getattr(s, k) for s in parts) for k in ("params", "grads", "optim")))


def rank_state(cfg, layout, stage: int, zero: str | None = None, replicas: int | None = None,
               device_type: str = "cuda") -> ModelState:
    """Model state of pipeline stage ``stage``'s ranks under ``zero`` (default: the config's)."""
    p = rank_params(cfg, layout, stage)
    replicas = cfg.parallel.hsdp_replicas if replicas is None else replicas
    return params_state(p.dense, p.experts, layout.dp * layout.cp, layout.edp, zero or cfg.parallel.zero,
                        state_dtypes(cfg.train, device_type), replicas)


def grad_buffer(cfg, layout, params, zero: str | None = None, device_type: str = "cuda") -> float:
    """Bytes of the full, unsharded gradient buffer a rank of ``params`` (:class:`RankParams`) holds
    from its first backward to the end of the step beyond what :func:`params_state` counts: ZeRO-2/3
    (par-zero's flat buffer, torch's FSDP2 alike) accumulate full gradients while gradient sync is
    off, which the trainer does for a whole pipeline schedule, and at pp = 1 for every micro-batch
    but the last. ZeRO-1 and DDP keep that buffer always (it is their model state)."""
    zero = zero or cfg.parallel.zero
    if zero not in ("optim_grads", "optim_grads_params", "torch_fsdp2"):
        return 0.0
    if layout.pp == 1 and layout.microbatches == 1:
        return 0.0  # one backward, grads reduced bucket by bucket as they arrive
    return (params.dense + params.experts) * bytes_per_param(*state_dtypes(cfg.train, device_type))[1]
