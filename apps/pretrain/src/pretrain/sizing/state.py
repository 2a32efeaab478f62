"""Model-state bytes of one rank: par-zero's convention and memory model on the rank's parameters.

The trainer's mixed precision (Megatron's): bf16 parameters for compute (fp32 runs: fp32),
gradients accumulated and reduced in ``[train].grad_reduce_dtype`` and, in the optimizer, fp32
main weights (bf16 runs only) and the state ``[train].optimizer``'s declaration names per parameter
(``par_zero.Declaration.state_bytes``: AdamW's two fp32 moments, SGD's or Lion's one momentum, what a
torch.optim class keeps): :func:`par_zero.bytes_per_param`. They are sharded as the ZeRO strategy says
(:func:`par_zero.model_state`): dense parameters over dp x cp, routed experts over expert dp; with HSDP,
ZeRO-3 inside each replica. A matrix-wise optimizer (Muon) keeps its matrix state (one fp32 momentum)
for the params it steps as matrices, its other state (AdamW's moments) for the rest.
"""

from __future__ import annotations

import torch

from par_zero import ModelState, bytes_per_param, model_state

from .params import RankParams, rank_params

MUON_STATE_BYTES = 4  # Muon's state per param it steps: one fp32 momentum (AdamW's: two fp32 moments, 8)
ADAMW_BYTES = (8, MUON_STATE_BYTES)  # optim_bytes of the default AdamW (and Muon): see optim_bytes
STRATEGIES = (("DDP", "no_shard"), ("ZeRO-1", "optim"), ("ZeRO-2", "optim_grads"), ("ZeRO-3", "optim_grads_params"))


def state_dtypes(train, device_type: str = "cuda") -> tuple[torch.dtype, torch.dtype]:
    """(parameter dtype, gradient-reduction dtype) of ``[train]`` on ``device_type``."""
    bf16 = train.resolved_dtype(device_type) == "bf16"
    param = torch.bfloat16 if bf16 else torch.float32
    return param, torch.bfloat16 if bf16 and train.grad_reduce_dtype == "bf16" else torch.float32


def optim_bytes(train) -> tuple[int, int]:
    """(state bytes per element, of an element stepped as a matrix) that ``[train].optimizer`` declares."""
    decl = train.optimizer_declaration
    return decl.state_bytes(), decl.state_bytes(matrix=True)


def convention(train, device_type: str = "cuda") -> str:
    """The bytes per parameter in words, for the plan's output."""
    decl, (state, matrix) = train.optimizer_declaration, optim_bytes(train)
    p, g, o = bytes_per_param(*state_dtypes(train, device_type), state)
    main = " + fp32 main weights" if o > state else ""
    matrices = (f" ({decl.label}'s matrices: {decl.describe(matrix=True)}, {p} + {g} + {o - state + matrix})"
                if decl.gathers == "matrix" else "")
    return f"{8 * p}-bit params, {8 * g}-bit grads, {decl.describe()}{main}: {p} + {g} + {o} bytes per parameter{matrices}"


def muon_elements(train, params: RankParams) -> tuple[int, int]:
    """(dense, routed-expert) elements of ``params`` a matrix-wise optimizer (Muon) steps as matrices: none
    for an element-wise one, else the hidden matrices and every routed expert (model/muon_split.py)."""
    return (params.muon_dense, params.experts) if train.optimizer_declaration.gathers == "matrix" else (0, 0)


def params_state(dense: float, experts: float, d: int, ed: int, zero: str, dtypes, replicas: int = 1,
                 muon: tuple[float, float] = (0, 0), optim: tuple[int, int] = ADAMW_BYTES) -> ModelState:
    """Bytes of ``dense`` elements sharded over ``d`` ranks and ``experts`` over ``ed``; ``replicas`` > 1:
    HSDP (ZeRO-3 inside ``d / replicas`` ranks, replicated across the replicas). ``muon``: how many of
    the dense and of the expert elements are stepped as matrices (:func:`muon_elements`); ``optim``: the
    optimizer's state bytes per element and per such element (:func:`optim_bytes`)."""
    p, g, o = bytes_per_param(*dtypes, optim[0])
    zero = "optim_grads_params" if zero == "torch_fsdp2" else zero  # torch's FSDP2 shards as ZeRO-3
    parts = []
    for n, size, mu in ((dense, d, muon[0]), (experts, ed, muon[1])):
        optim_total = n * o - mu * (optim[0] - optim[1])
        if replicas > 1:
            parts.append(model_state(n * p, n * g, optim_total, "optim_grads_params", max(size // replicas, 1),
                                     outer=replicas))
        else:
            parts.append(model_state(n * p, n * g, optim_total, zero, size))
    return ModelState(*(sum(getattr(s, k) for s in parts) for k in ("params", "grads", "optim")))


def rank_state(cfg, layout, stage: int, zero: str | None = None, replicas: int | None = None,
               device_type: str = "cuda") -> ModelState:
    """Model state of pipeline stage ``stage``'s ranks under ``zero`` (default: the config's)."""
    p = rank_params(cfg, layout, stage)
    replicas = cfg.parallel.hsdp_replicas if replicas is None else replicas
    zero = zero or cfg.parallel.zero
    dtypes = state_dtypes(cfg.train, device_type)
    return with_buddy(cfg, params_state(p.dense, p.experts, layout.dp * layout.cp, layout.edp, zero, dtypes, replicas,
                                        muon_elements(cfg.train, p), optim_bytes(cfg.train)), zero, layout.dp * layout.cp,
                      dtypes)


BUDDY_LEVELS = ("optim", "optim_grads", "optim_grads_params")  # par's ZeRO levels with buddy shards (par_zero/buddy.py)


def with_buddy(cfg, state: ModelState, zero: str, d: int, dtypes) -> ModelState:
    """``[train].buddy_shards = 1`` under ZeRO-1, 2 or 3 over ``d`` > 1 ranks: a second shard of optimizer state
    (the next rank's, and its fp32 masters where the params are not fp32); under ZeRO-2/3 a second shard of the
    reduced gradients too (ZeRO-1 holds the whole buffer already); under ZeRO-3 with fp32 params (``dtypes``:
    :func:`state_dtypes`) a second param shard, the buddy's master being the next rank's param shard."""
    if not cfg.train.buddy_shards or zero not in BUDDY_LEVELS or d < 2:
        return state
    zero3_fp32 = zero == "optim_grads_params" and dtypes[0] == torch.float32
    return ModelState(2 * state.params if zero3_fp32 else state.params, state.grads if zero == "optim" else 2 * state.grads,
                      2 * state.optim)


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
