"""How a Trainer runs its micro-batches: through a pipeline schedule or by plain accumulation.

One object per Trainer, chosen once at construction (``make_runner``), so the step, the evaluation and
the logits never ask "pipelined or not". Both take the trainer's own forward and loss (per batch: its
packed documents travel with them) and return what the last chunk produced on this rank.
"""

from __future__ import annotations

import time

import torch


class Accumulation:
    """No pipeline: each micro-batch's forward and backward on this rank, gradients reduced with the last."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def train(self, batch) -> list[torch.Tensor]:
        t, dp, n = self.trainer, self.trainer.model.dp, len(batch.inputs)
        losses = []
        for m in range(n):
            dp.set_grad_sync(m == n - 1)
            loss = t.loss(t.forward_chunk(batch, 0, dp, batch.inputs[m], m), batch.labels[m], batch)
            (loss / n).backward()
            losses.append(loss.detach())
        dp.set_grad_sync(True)
        return losses

    def eval_losses(self, batch) -> list[torch.Tensor]:
        t = self.trainer
        return [t.loss(t.forward_chunk(batch, 0, t.model.dp, x, m), y, batch)
                for m, (x, y) in enumerate(zip(batch.inputs, batch.labels))]

    def last_output(self, x0: torch.Tensor) -> torch.Tensor:
        out = self.trainer.model.dp(x0)
        return out[0] if isinstance(out, tuple) else out  # MTP: (logits, hidden)


class Pipelined:
    """The schedule (par-pp's executor) runs every micro-batch; gradients are reduced once, after it."""

    def __init__(self, trainer, executor) -> None:
        self.trainer, self.executor = trainer, executor

    def train(self, batch) -> list[torch.Tensor]:
        t, dp = self.trainer, self.trainer.model.dp
        dp.set_grad_sync(False)  # the schedule runs many backwards: reduce once, after it
        start = time.perf_counter()
        losses = self.executor.step(batch.inputs, batch.labels, **t.callbacks(batch))
        t.timer.pipeline(self.executor.records, time.perf_counter() - start)
        dp.reduce_grads()
        return [loss.detach() for loss in losses] if losses else []

    def eval_losses(self, batch) -> list[torch.Tensor]:
        t = self.trainer  # the last chunk's rank gets the outputs
        outs = self.executor.forward(batch.inputs, forward_fn=t.callbacks(batch)["forward_fn"])
        return [t.loss(x, y, batch) for x, y in zip(outs, batch.labels)]

    def last_output(self, x0: torch.Tensor) -> torch.Tensor | None:
        outs = self.executor.forward([x0])  # whole sequences: the default callbacks (with shape headers)
        out = outs[0] if outs else None
        return out[0] if isinstance(out, tuple) else out  # MTP: (logits, hidden); None off the last chunk


def make_runner(trainer, message_shape, default_callbacks: dict) -> Accumulation | Pipelined:
    """The trainer's runner: a pipeline executor over its chunks when the model has a schedule
    (``default_callbacks``: its forward and loss for whole sequences, as ``logits`` runs them)."""
    model = trainer.model
    if model.schedule is None:
        return Accumulation(trainer)
    from par_pp import PipelineExecutor

    executor = PipelineExecutor(model.schedule, model.chunks, trainer.groups.pp, device=trainer.device,
                                message_shape=message_shape, **default_callbacks)
    return Pipelined(trainer, executor)
