"""Any ``torch.optim`` optimizer over the bucket masters, for the unsharded strategy ('no_shard').

Each trainable param's fp32 master is a view of its bucket's master shaped like the param (a view
of a tensor that does not require grad is a leaf, which torch.optim accepts); before each step its
``.grad`` is set to the view of the reduced fp32 grads. The weight-decay mask is two param groups
(decay / no decay) when the class takes ``weight_decay``. The per-param state tensors the class
keeps (SGD's ``momentum_buffer``, Adagrad's ``sum``, ...) are re-bound after each step to views of
one flat tensor per state name over the bucket, so a checkpoint saves and loads them as pieces,
like the masters; scalar state (``step``) travels as numbers and goes back through torch's own
``load_state_dict`` (which puts each on the device and dtype the class wants).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

# check_optimizer and optimizer_classes are re-exported: they lived here before optimizer_choice.py
from .optimizer_choice import (check_optimizer, fastest_implementation, optimizer_classes,  # noqa: F401
                               takes_weight_decay)

if TYPE_CHECKING:
    from .bucket import Bucket


def scalar_state_of(optimizer: torch.optim.Optimizer | None) -> dict[str, float]:
    """The per-param scalar state (e.g. ``step``), alike for every param: every step steps them all."""
    for state in (optimizer.state.values() if optimizer is not None else ()):
        return {k: float(v) for k, v in state.items()
                if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.dim() == 0)}
    return {}


class TorchOptimizer:
    """A ``torch.optim`` class stepping the masters of ``buckets`` (each rank holds whole params)."""

    def __init__(self, buckets: list[Bucket], cfg, decayed: Callable[[nn.Parameter], bool], decl=None):
        cls, args = (decl or cfg.declaration).torch_optimizer()  # a TorchClass declaration (declaration.py)
        self.buckets, self.cfg, self.lr, self.step_count = buckets, cfg, cfg.lr, 0
        self.views: dict[Bucket, list[tuple[torch.Tensor, int, int]]] = {}  # master view, its range in the bucket
        decay, keep = [], []
        for b in buckets:
            self.views[b] = []
            for p, _, lo, hi, p_lo in b.opt_segments():
                if p_lo != 0 or hi - lo != p.numel():
                    raise ValueError("a torch.optim optimizer needs whole params on each rank (strategy 'no_shard')")
                v = b.master[lo:hi].view(p.shape)
                self.views[b].append((v, lo, hi))
                (decay if decayed(p) else keep).append(v)
        if takes_weight_decay(cls):
            groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": keep, "weight_decay": 0.0}]
        else:
            groups = [{"params": decay + keep}]
        groups = [g for g in groups if g["params"]]
        fast = fastest_implementation(cls, buckets[0].master.device, args) if groups else {}
        self.inner = cls(groups, lr=cfg.lr, **fast, **args) if groups else None
        self.flat: dict[Bucket, dict[str, torch.Tensor]] = {b: {} for b in buckets}  # per state name, over the range
        self._bind()

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for g in self.inner.param_groups if self.inner else ():
            g["lr"] = lr

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        if self.inner is None:
            return
        for b, views in self.views.items():
            # torch.optim steps every param at once, so bf16 grads need all of their fp32 copy now: a transient
            # (the caching allocator's on CUDA) rather than a buffer that would stay through forward/backward
            grad = b.opt_grad if b.opt_grad.dtype == torch.float32 else b.opt_grad.float()
            for v, lo, hi in views:
                v.grad = grad[lo:hi].view(v.shape)
        self.inner.step()
        for views in self.views.values():
            for v, _, _ in views:
                v.grad = None
        self._bind()

    @torch.no_grad()
    def _bind(self) -> None:
        """Make every per-param state tensor a view of its flat tensor (copied there once, when new)."""
        for b, views in self.views.items():
            for v, lo, hi in views:
                state = self.inner.state.get(v, {})
                for key, t in list(state.items()):
                    if not torch.is_tensor(t) or t.dim() == 0:
                        continue  # scalars: see scalar_state
                    if t.shape != v.shape:
                        raise ValueError(f"{type(self.inner).__name__} state {key!r} is not shaped like its param")
                    flat = self.flat[b].get(key)
                    if flat is None:
                        flat = self.flat[b][key] = torch.zeros(b.master.shape, dtype=t.dtype, device=t.device)
                    view = flat[lo:hi].view(v.shape)
                    if t.data_ptr() != view.data_ptr():
                        view.copy_(t)
                        state[key] = view

    # ---- state, for checkpoints and measuring ---------------------------------------------
    def state_kinds(self) -> tuple[str, ...]:
        """The names of the per-param state tensors (empty before the first step, for lazy classes)."""
        return tuple(sorted({k for flats in self.flat.values() for k in flats}))

    def range_state(self, bucket: Bucket, kind: str) -> torch.Tensor:
        if kind == "master":
            return bucket.master
        if kind not in self.flat[bucket]:
            raise ValueError(f"kind={kind!r} is not one of master, {', '.join(self.state_kinds()) or '(no state yet)'}")
        return self.flat[bucket][kind]

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for flats in self.flat.values() for t in flats.values()]

    def scalar_state(self) -> dict[str, float]:
        return scalar_state_of(self.inner)

    def prepare_load(self, kinds) -> None:
        """Zeros for the state ``kinds`` a checkpoint holds, for loading its pieces into (then :meth:`finish_load`)."""
        for b in self.buckets:
            for kind in kinds:
                self.flat[b].setdefault(kind, torch.zeros_like(b.master, dtype=torch.float32))

    @torch.no_grad()
    def finish_load(self, scalars: dict[str, float]) -> None:
        """Hand the loaded state tensors and ``scalars`` to the class, through its own ``load_state_dict``."""
        if self.inner is None:
            return
        index = {id(p): i for i, p in enumerate(p for g in self.inner.param_groups for p in g["params"])}
        state = {}
        for b, views in self.views.items():
            for v, lo, hi in views:
                state[index[id(v)]] = {k: f[lo:hi].view(v.shape) for k, f in self.flat[b].items()} | {
                    k: torch.tensor(x) for k, x in scalars.items()}
        self.inner.load_state_dict({"state": state, "param_groups": self.inner.state_dict()["param_groups"]})
        self._bind()
