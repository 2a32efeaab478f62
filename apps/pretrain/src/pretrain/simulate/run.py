"""Simulate one rank of a world of N: the trainer's real code on fake tensors and a fake process group.

Construction, the DP wrapper, one optimizer step (every micro-batch through the pipeline
schedule, backward, gradient reduction, clipping, AdamW) and the building of a checkpoint's
tensors run exactly as in ``pretrain train``; tensors carry shapes, not values
(``FakeTensorMode``), and every collective returns at once (torch's ``fake`` backend), so one
process plays any rank of any world. :class:`MemoryTracker` counts what is allocated.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import torch

from par_moe import DeclaredRouting

from ..config.train_section import PAR_FP8
from ..errors import UsageError
from ..sizing.activations import routed_sizes
from ..sizing.memory import rank_memory
from ..sizing.replicas import replica_figures, stage_moe_layers
from ..sizing.state import state_dtypes
from .memory import MemoryTracker


def default_roles(cfg, layout) -> dict[int, list[str]]:
    """The global ranks (tp, cp, dp rank 0) of the first, a middle and the last pipeline stage, and of
    the stages the plan calls heaviest: by memory (:func:`pretrain.sizing.memory.worst_stage`, what
    ``plan --auto`` judges a layout by) and by time (the most layers: the busiest stage sets the
    pace), each with why it was picked."""
    from ..sizing.memory import stage_sizes, worst_stage

    stages = layout.grid.ranks("pp")[0]  # the pp group of rank 0, by stage
    roles: dict[int, list[str]] = {}
    for stage, why in ((0, "first"), (layout.pp // 2, "middle"), (layout.pp - 1, "last")):
        roles.setdefault(stage, []).append(why)
    if layout.pp > 1:
        _, heaviest, _, _ = worst_stage(cfg, layout, stage_sizes(cfg, layout), cfg.parallel.zero)
        per_stage = [len(ids) for ids in cfg.parallel.stage_layers(cfg.model.layers)]
        roles.setdefault(heaviest, []).append("heaviest by memory")
        roles.setdefault(per_stage.index(max(per_stage)), []).append("heaviest by time")
    return {stages[s]: roles[s] for s in sorted(roles)}


def check_rank(rank: int, world: int) -> None:
    if not 0 <= rank < world:
        raise UsageError(f"--rank {rank} is not a rank of --world {world}; use 0..{world - 1}")


def _state_tensors(dp) -> dict[str, list[torch.Tensor]]:
    """par-zero's own account of what it holds; torch's FSDP2 gives none (its tensors stay 'other')."""
    return dp.state_tensors() if hasattr(dp, "state_tensors") else {}


def _group_names(groups) -> dict[int, str]:
    """id(ProcessGroup) -> the first ParallelGroups name for it (groups with equal members are shared)."""
    names: dict[int, str] = {}
    for name in ("tp", "pp", "dp", "cp", "dp_cp", "ep", "etp", "edp", "tp_ep", "tp_cp", "tp_pp", "tp_dp_cp",
                 "tp_ep_pp", "embedding"):
        g = groups.groups.get(name)
        if g is not None:
            names.setdefault(id(g), name)
    return names


def simulate_rank(cfg, world: int, rank: int, imbalance: float = 1.0, on_phase=lambda name: None) -> dict:
    """Run one training step and a checkpoint build as rank ``rank`` of ``world``; measured and planned bytes.
    MoE layers route as declared (see ``par_moe.declared``): balanced, or expert 0 ``imbalance`` x its share.
    ``on_phase(name)`` is called as each phase starts ("build", "step", "save"), for a progress display."""
    with warnings.catch_warnings():  # fake tensors warn about what they cannot know; nothing for the user
        warnings.simplefilter("ignore", UserWarning)
        return _simulate_rank(cfg, world, rank, imbalance, on_phase)


def _simulate_rank(cfg, world: int, rank: int, imbalance: float, on_phase) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from par_groups import comm, fake_world

    from ..checkpoint.store import checkpoint_tensors
    from ..data import load_dataset
    from ..training.train_loop import ShapesOnly, Trainer

    layout = cfg.validate_world(world)
    check_rank(rank, world)
    dataset = load_dataset(dataclasses.replace(cfg.data, path="", blend=[]), cfg.model.vocab_size)  # shapes only: embedded data
    timings = {}
    with fake_world(rank, world):
        tracker = MemoryTracker()
        t0 = time.perf_counter()
        from ..model.offload import host_copies

        # [model].offload's host copies are not the device's
        with FakeTensorMode(allow_non_fake_inputs=True), tracker, host_copies(tracker.host_memory):
            on_phase("build")
            tracker.phase = "other"
            trainer = Trainer(cfg, dataset=dataset, shapes_only=ShapesOnly(DeclaredRouting(imbalance)))
            build = tracker.snapshot()
            timings["build_s"] = time.perf_counter() - t0
            tracker.retag(_state_tensors(trainer.model.dp))
            tracker.phase = "activations"
            tracker.reset_peak()
            on_phase("step")
            t1 = time.perf_counter()
            with comm.CommRecorder() as rec:
                trainer.train_step(0)
            step = tracker.snapshot()
            offloader = next((layer.offloader for chunk in trainer.model.chunks.values()
                              for layer in chunk.decoder_layers()), None)  # [model].offload's, one per rank
            timings["step_s"] = time.perf_counter() - t1
            tracker.phase = "save"
            tracker.reset_peak()
            on_phase("save")
            t2 = time.perf_counter()
            with comm.CommRecorder() as save_rec:
                tensors = checkpoint_tensors(trainer.checkpointed(), with_optim=True)
            save = tracker.snapshot()
            del tensors
            timings["save_s"] = time.perf_counter() - t2
        g = trainer.groups
        stage = g.rank_in("pp")
        names = _group_names(g)
        ep_rank = g.grid.coords(rank).get("ep", 0)
        planned = rank_memory(cfg, layout, stage, routing=DeclaredRouting(imbalance), ep_rank=ep_rank)
        replicas = {}
        if cfg.model.is_moe and cfg.model.expert_balance != "none":  # sizing.replicas, under the declared routing
            replicas = {"replicas": replica_figures(cfg, layout, stage_moe_layers(cfg, layout, stage),
                                                    state_dtypes(cfg.train)[0].itemsize,
                                                    routed_sizes(cfg, layout, DeclaredRouting(imbalance), ep_rank).pairs, ep_rank)}
        if offloader is not None:  # what [model].offload moved out and back in the step, beside the plan's
            from ..sizing.offload import offloaded_bytes

            replicas["offloaded"] = {"out": offloader.bytes_out, "back": offloader.bytes_in,
                                     "planned": offloaded_bytes(cfg, layout, stage)}
        return {**replicas,
            "rank": rank, "stage": stage, "coords": g.grid.coords(rank),
            "layers": cfg.parallel.stage_layers(cfg.model.layers)[stage],
            "measured": {k: v for k, v in step["by_category"].items() if k != "save"},
            "measured_peak": step["peak"], "planned": planned, "planned_peak": sum(planned.values()),
            "build_peak": build["peak"], "save_peak": save["peak"],
            "largest_state_tensor": {k: tracker.largest[k] for k in ("params", "grads", "optim")},
            "collectives": _summarize(rec.records, names, cfg.train.fp8 in PAR_FP8),
            "save_collectives": _summarize(save_rec.records, names),
            "timings_s": timings,
        }


def _summarize(records, names: dict[int, str], by_dtype: bool = False) -> list[dict]:
    """Per (op, group): count and bytes; ``by_dtype`` (par's FP8 on): the bytes of each dtype moved too."""
    out: dict[tuple, dict] = {}
    for r in records:
        group = names.get(id(r.group), f"size {r.group_size}") if r.group is not None else "world"
        row = out.setdefault((r.op, group), {"op": r.op, "group": group, "group_size": r.group_size, "count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += r.bytes
        if by_dtype:
            kinds = row.setdefault("by_dtype", {})
            kinds[str(r.dtype)] = kinds.get(str(r.dtype), 0) + r.bytes
    return sorted(out.values(), key=lambda x: (x["group"], x["op"]))
