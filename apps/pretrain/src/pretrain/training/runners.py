"""How a Trainer runs its micro-batches: through a pipeline schedule or by plain accumulation.

One object per Trainer, chosen once at construction (``make_runner``), so the step, the evaluation and
the logits never ask "pipelined or not". Both take what they run as arguments: the DP wrapper, and per
batch the forward and loss (``callbacks(batch)``: its packed documents travel with them); they return
what the last chunk produced on this rank.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

Callbacks = Callable[[object], dict]  # a batch -> {"forward_fn": (chunk, module, x, m) -> out, "loss_fn": (out, y) -> loss}


class Accumulation:
    """No pipeline: each micro-batch's forward and backward on this rank, gradients reduced with the last."""

    def __init__(self, dp, callbacks: Callbacks) -> None:
        """``dp``: the DP wrapper around the rank's one chunk; ``callbacks``: a batch's forward and loss."""
        self.dp, self.callbacks = dp, callbacks

    def train(self, batch) -> list[torch.Tensor]:
        dp, n, calls = self.dp, len(batch.inputs), self.callbacks(batch)
        forward, loss_of = calls["forward_fn"], calls["loss_fn"]
        losses = []
        for m in range(n):
            dp.set_grad_sync(m == n - 1)
            loss = loss_of(forward(0, dp, batch.inputs[m], m), batch.labels[m])
            (loss / n).backward()
            losses.append(loss.detach())
        dp.set_grad_sync(True)
        return losses

    def eval_losses(self, batch) -> list[torch.Tensor]:
        calls = self.callbacks(batch)
        forward, loss_of = calls["forward_fn"], calls["loss_fn"]
        return [loss_of(forward(0, self.dp, x, m), y) for m, (x, y) in enumerate(zip(batch.inputs, batch.labels))]

    def last_output(self, x0: torch.Tensor) -> torch.Tensor:
        out = self.dp(x0)
        return out[0] if isinstance(out, tuple) else out  # MTP: (logits, hidden)


class Pipelined:
    """The schedule (par-pp's executor) runs every micro-batch; gradients are reduced once, after it."""

    def __init__(self, dp, executor, callbacks: Callbacks, timer) -> None:
        """``timer``: where the schedule's time goes (``StepTimer.pipeline``)."""
        self.dp, self.executor, self.callbacks, self.timer = dp, executor, callbacks, timer

    def train(self, batch) -> list[torch.Tensor]:
        self.dp.set_grad_sync(False)  # the schedule runs many backwards: reduce once, after it
        start = time.perf_counter()
        losses = self.executor.step(batch.inputs, batch.labels, **self.callbacks(batch))
        self.timer.pipeline(self.executor.records, time.perf_counter() - start)
        self.dp.reduce_grads()
        return [loss.detach() for loss in losses] if losses else []

    def eval_losses(self, batch) -> list[torch.Tensor]:
        calls = self.callbacks(batch)  # the last chunk's rank gets the outputs
        outs = self.executor.forward(batch.inputs, forward_fn=calls["forward_fn"])
        return [calls["loss_fn"](x, y) for x, y in zip(outs, batch.labels)]

    def last_output(self, x0: torch.Tensor) -> torch.Tensor | None:
        outs = self.executor.forward([x0])  # whole sequences: the default callbacks (with shape headers)
        out = outs[0] if outs else None
        return out[0] if isinstance(out, tuple) else out  # MTP: (logits, hidden); None off the last chunk


def make_runner(model, pp_group, device, message_shape, callbacks: Callbacks, default_callbacks: dict,
                timer) -> Accumulation | Pipelined:
    """The runner of ``model`` (a ``RankModel``): a pipeline executor over its chunks (in ``pp_group``) when
    it has a schedule. ``callbacks``: a batch's forward and loss; ``default_callbacks``: those for whole
    sequences, as ``logits`` runs them; ``message_shape``: the pipeline messages' declared shape (or None)."""
    if model.schedule is None:
        return Accumulation(model.dp, callbacks)
    from par_pp import PipelineExecutor

    executor = PipelineExecutor(model.schedule, model.chunks, pp_group, device=device,
                                message_shape=message_shape, **default_callbacks)
    return Pipelined(model.dp, executor, callbacks, timer)
