"""The reference's own rounding noise, measured: the same step from the same state in fp64.

The one-rank reference is the trainer in fp32. Its fp64 twin is a deep copy of its model chunk in
float64 (the same weights to the last bit, every buffer too), run on the same micro-batches with the
trainer's own loss; while it runs, ``Tensor.float()``, ``.to(torch.float32)`` and ``new_zeros(...,
dtype=torch.float32)`` keep fp64 tensors in fp64 (the model and the losses compute "in fp32" by those
calls), so nothing rounds to fp32 on the way. What differs between the twin and the reference is fp32's rounding alone: for the loss, the
grad norm, every module output and every parameter gradient, the relative distance
``||fp32 - fp64|| / ||fp64||`` is the noise that a correct layout's difference is measured against
(as the suite's ``layout_runs.fp64_noise``). The gradient is the raw sum of the micro-batches'
backwards (one rank: nothing to reduce), before clipping, as the reference's clip sees it.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.distributed as dist


NEW = ("new_zeros", "new_ones", "new_empty", "new_full")  # a fp64 tensor's new ones in fp32: in fp64


@contextlib.contextmanager
def fp64_compute():
    """While open (this process only): ``float()``, ``.to(float32)`` and ``new_zeros(..., dtype=float32)``
    (and the other ``new_*``) leave fp64 tensors in fp64."""
    float_, to = torch.Tensor.float, torch.Tensor.to
    made = {name: getattr(torch.Tensor, name) for name in NEW}

    def keep_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else float_(self, *args, **kwargs)

    def keep_to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    def keep_new(make):
        def new(self, *args, **kwargs):
            if self.dtype == torch.float64 and kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
            return make(self, *args, **kwargs)
        return new

    torch.Tensor.float, torch.Tensor.to = keep_float, keep_to
    for name, make in made.items():
        setattr(torch.Tensor, name, keep_new(make))
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = float_, to
        for name, make in made.items():
            setattr(torch.Tensor, name, make)


class _KeepGroups:
    """Process groups are shared, not copied, by ``copy.deepcopy``."""

    def __enter__(self):
        self.cls = dist.ProcessGroup
        self.had = "__deepcopy__" in self.cls.__dict__
        self.cls.__deepcopy__ = lambda pg, memo: pg
        return self

    def __exit__(self, *exc):
        if not self.had:
            del self.cls.__deepcopy__


def fp64_twin(chunk: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a one-rank model chunk, without the hooks of the data-parallel wrapper."""
    with _KeepGroups():
        twin = copy.deepcopy(chunk)
    for module in twin.modules():
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
        module._backward_hooks.clear()
        module._backward_pre_hooks.clear()
    for p in twin.parameters():
        p.grad = None
        p._backward_hooks = None if hasattr(p, "_backward_hooks") else None
    return twin.double()


def fp64_step(trainer, batch, recorder_cls) -> tuple[float, float, dict, dict]:
    """The reference's step on ``batch`` (its MicroBatches) in fp64 from its current weights, without
    an update: (loss, grad norm, module outputs per name and micro-batch, gradients by full name)."""
    if trainer.model.num_chunks != 1:
        raise ValueError("the fp64 twin is the one-rank reference's (one chunk)")
    chunk = trainer.model.chunks[0]
    twin = fp64_twin(chunk)
    names = {id(p): n for n, p in zip(_full_names(trainer, chunk), chunk.parameters())}
    twin_names = {id(q): names[id(p)] for p, q in zip(chunk.parameters(), twin.parameters())}
    trainer.model.chunks[0] = twin  # the trainer's loss reaches the MTP modules through it
    recorder = recorder_cls(trainer, {0: twin})
    recorder.install()
    losses = []
    try:
        with fp64_compute():
            n = len(batch.inputs)
            for m in range(n):
                out = trainer.forward_chunk(batch, 0, twin, batch.inputs[m], m)
                loss = trainer.loss(out, batch.labels[m], batch)
                (loss / n).backward()
                losses.append(loss.detach().double())
    finally:
        recorder.close()
        trainer.model.chunks[0] = chunk
    grads = {twin_names[id(p)]: p.grad.detach().clone() for p in twin.parameters()
             if p.grad is not None and id(p) in twin_names}
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    return float(torch.stack(losses).mean()), norm, recorder.outputs, grads


def _full_names(trainer, chunk) -> list[str]:
    """The full-model names of ``chunk.parameters()``, in order."""
    by_id = {id(t): name for name, t in trainer.model.full_named_tensors().items()}
    return [by_id.get(id(p), "?") for p in chunk.parameters()]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp64; positions where ``b`` is not finite must hold the same value in
    ``a`` (the masked vocabulary padding is -inf), else the error is infinite."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    if not bool(finite.all()):
        if not bool((a[~finite] == b[~finite]).all()):
            return math.inf
        a, b = a[finite], b[finite]
    denominator = float(b.norm())
    diff = float((a - b).norm())
    if denominator == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / denominator
