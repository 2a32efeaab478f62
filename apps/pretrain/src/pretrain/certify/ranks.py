"""What the ranks run: the one-rank reference, then the layout's ranks, step by step from its state.

The reference (one rank, fp32) saves a checkpoint before each step, measures its fp64 noise from
that state (:mod:`.fp64`), trains the step and records the loss, grad norm, every module output
(the whole batch) and every full gradient into ``<work>/reference.pt``. Each step of the layout
then starts from the reference's checkpoint of that step (resharded to the layout, as a resume
would be), so a difference cannot accumulate, and an MoE near-tie that one step flips does not set
the next steps apart: every step is the same computation from the same state (weights, optimizer,
batch) and must give the same numbers to rounding -- except where MoE routing flips at a near-tie
(:mod:`.routing`): counted on both sides every step, reported, not compared at the band.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import load_config
from . import coverage
from .fp64 import fp64_step, relative
from .localise import ShardContext, module_owners, output_errors
from .record import Recorder, capture_grads_at_clip, full_shapes
from .routing import compare_routing, gather_routing
from .verdict import judge_step, rel

REFERENCE = "reference.pt"
CHECKPOINTS = "checkpoints"


def _full_outputs(outputs: dict) -> dict:
    """Per module: its micro-batches' outputs side by side (batch dim 1) in micro-batch order."""
    return {name: torch.cat([per_mb[m] for m in sorted(per_mb)], dim=1) if per_mb[0].dim() >= 2 else per_mb[0]
            for name, per_mb in outputs.items() if 0 in per_mb}


def run_reference(config: str | None, overrides: list[str], steps: int, work: str, ids: list[int]) -> dict:
    """On a one-rank group: the reference's ``steps`` steps (see the module doc), its batches holding
    the vocabulary ``ids`` (:mod:`.coverage`); returns a summary."""
    from ..training.train_loop import Trainer

    trainer = Trainer(load_config(config, overrides))
    coverage.install(trainer.sampler, ids)
    shapes = full_shapes(trainer)
    sink: dict = {}
    capture_grads_at_clip(trainer, shapes, sink)
    # backward order: the one chunk's registration order (forward order) reversed; ``shapes`` is sorted by name
    # (lm_head would come last, layers.10 before layers.2)
    grad_order = [n for n in reversed(list(trainer.model.full_named_tensors())) if n in shapes]
    out = []
    for step in range(steps):
        trainer.save_checkpoint(Path(work) / CHECKPOINTS, step, keep=steps + 1)
        batch = trainer.microbatches(trainer._batch(step))
        loss64, norm64, outputs64, grads64 = fp64_step(trainer, batch, Recorder)
        r, recorder = recorded_step(trainer, step)
        full32, full64 = _full_outputs(recorder.outputs), _full_outputs(outputs64)
        grads = sink.pop("grads")
        out.append({"loss": r.loss, "grad_norm": r.grad_norm, "loss64": loss64, "norm64": norm64,
                    "order": [n for n in recorder.order if n in full32 or n in recorder.routed], "outputs": full32,
                    "grads": grads, "routed": recorder.routed, "margins": recorder.margins,
                    "noise_out": {n: relative(full32[n], full64[n]) for n in full32 if n in full64},
                    "noise_grad": {n: relative(grads[n], grads64[n]) for n in grads if n in grads64},
                    "grad_order": grad_order})
    torch.save({"steps": out, "shapes": shapes}, Path(work) / REFERENCE)
    return {"losses": [s["loss"] for s in out]}


def recorded_step(trainer, step: int):
    """``trainer.train_step(step)`` with every module's output and the routing recorded: (result, recorder)."""
    recorder = Recorder(trainer)
    recorder.install()
    try:
        return trainer.train_step(step), recorder
    finally:
        recorder.close()


def run_layout(config: str | None, overrides: list[str], steps: int, work: str, margin: float,
               ids: list[int]) -> list[dict]:
    """On the layout's process group: each step from the reference's state, with the reference's
    batches (the same vocabulary ``ids`` written in), judged (every rank returns the same records)."""
    from ..training.train_loop import Trainer

    trainer = Trainer(load_config(config, overrides))
    coverage.install(trainer.sampler, ids)
    ref = torch.load(Path(work) / REFERENCE, weights_only=True)  # a file in a directory the user names: no code
    shapes = full_shapes(trainer)
    sink: dict = {}
    capture_grads_at_clip(trainer, shapes, sink)
    ctx = ShardContext.of(trainer)
    owners = module_owners(trainer, ctx)
    records = []
    for step in range(steps):
        r_step = ref["steps"][step]
        loaded = trainer.load_checkpoint(Path(work) / CHECKPOINTS / f"step_{step}")
        assert loaded == step, (loaded, step)
        r, recorder = recorded_step(trainer, step)
        out_err, dims = output_errors(recorder.outputs, r_step["outputs"], r_step["order"], ctx)
        grads = sink.pop("grads")
        grad_err = {}
        if grads is not None:
            for name, g in grads.items():
                want = r_step["grads"].get(name)
                if want is None:
                    continue
                rows = tuple(slice(0, min(a, b)) for a, b in zip(g.shape, want.shape))  # vocabulary padding
                grad_err[name] = relative(g[rows], want[rows])
        # routed pairs: each rank routes its own tokens (dp, cp, and tp: a MoE layer takes its 1/tp of the
        # sequence with or without SP), so every rank counts; a layout that routed a token twice shows here
        routed = gather_routing(recorder.routed, True)
        routing = compare_routing(routed, r_step["routed"], r_step["margins"], r_step["order"],
                                  rel(r.loss, r_step["loss"])) if routed or r_step["routed"] else None
        records.append(judge_step(step, {"loss": r.loss, "grad_norm": r.grad_norm}, r_step, out_err, grad_err, dims,
                                  owners, r_step["order"], r_step["grad_order"], ctx, margin, routing))
    return records
