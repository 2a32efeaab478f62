"""One rank's memory at its peak (model state + activations), the heaviest stage, and the budget.

`plan` prints it for the config's layout, `plan --auto` keeps the layouts whose heaviest stage
fits :func:`budget_bytes`, and `plan --simulate` prints it beside what it measures.
"""

from __future__ import annotations


from par_zero import ModelState

from .activations import stage_peak_of
from .params import RankParams, rank_params
from .schedule_peak import StagePeak
from .state import grad_buffer, muon_elements, optim_bytes, params_state, rank_state, state_dtypes, with_buddy

GB = 1e9
HEADROOM = 0.10  # of GPU memory, for the CUDA context, NCCL buffers and allocator fragmentation


def budget_bytes(gpu_memory_gb: float) -> float:
    """What a rank may use of a GPU of ``gpu_memory_gb``: the memory less :data:`HEADROOM`."""
    return gpu_memory_gb * GB * (1 - HEADROOM)


def rank_memory(cfg, layout, stage: int, zero: str | None = None, routing=None, ep_rank: int = 0) -> dict[str, float]:
    """Bytes of params, grads, optimizer state and activations pipeline stage ``stage`` holds at its
    peak; activations include ZeRO-2/3's full gradient buffer while gradients accumulate
    (:func:`.state.grad_buffer`), as ``plan --simulate`` counts it."""
    s = rank_state(cfg, layout, stage, zero)
    buffer = grad_buffer(cfg, layout, rank_params(cfg, layout, stage), zero)
    return {"params": s.params, "grads": s.grads, "optim": s.optim,
            "activations": stage_peak_of(cfg, layout, stage, routing, ep_rank).with_grads(buffer)}


def stage_sizes(cfg, layout) -> list[tuple[RankParams, StagePeak]]:
    """(parameter elements, activation peak) of every pipeline stage's ranks."""
    return [(rank_params(cfg, layout, s), stage_peak_of(cfg, layout, s)) for s in range(layout.pp)]


def worst_stage(cfg, layout, stages: list[tuple[RankParams, StagePeak]], zero: str,
                replicas: int = 1) -> tuple[float, int, ModelState, float]:
    """(peak bytes, stage, its model state, its activations) of the stage of ``stages`` that holds the
    most under ``zero`` (``replicas`` > 1: HSDP)."""
    dtypes, d = state_dtypes(cfg.train), layout.dp * layout.cp
    best = None
    for stage, (p, peak) in enumerate(stages):
        state = with_buddy(cfg, params_state(p.dense, p.experts, d, layout.edp, zero, dtypes, replicas,
                                             muon_elements(cfg.train, p), optim_bytes(cfg.train)), zero, d, dtypes)
        act = peak.with_grads(grad_buffer(cfg, layout, p, zero))
        if best is None or state.total + act > best[0]:
            best = (state.total + act, stage, state, act)
    return best
