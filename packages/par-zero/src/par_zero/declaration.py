"""An optimizer, declared once: its state per parameter, how it steps, what it needs gathered.

Whatever reads an optimizer reads its declaration: :class:`DataParallel` runs it in the loop for its
kind (optimizer_loops.py), the strategy check asks it (:meth:`Declaration.check`), a planner
sizes its state (:meth:`Declaration.state_bytes`), checkpoints name its state (:meth:`Declaration.kinds`).
Two shapes of step:

- element-wise (:class:`AdamW`, :class:`SGD`, :class:`Lion`): :meth:`Elementwise.step_` on any flat range
  of elements, the same arithmetic on a rank's optimizer range as on the whole param, so every ZeRO
  stage steps its shard with nothing gathered (elementwise.py runs it);
- matrix-wise (:class:`Muon`): the update needs each whole matrix, gathered to one owner rank per matrix
  (muon.py); its momentum is still element-wise state over the optimizer range.

A ``torch.optim`` class (:class:`TorchClass`) is stepped by torch on whole params (strategy 'no_shard'
or 'torch_fsdp2'); its state is what one step on a small tensor shows.

A new element-wise optimizer is one subclass of :class:`Elementwise` (its state, its step, its checks)
and one entry in :data:`DECLARED`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Callable, ClassVar

import torch

from .adamw import adamw_step_
from .optimizer_choice import check_optimizer, muon_args, optimizer_class

OWN_STRATEGIES = "'no_shard', 'optim', 'optim_grads' or 'optim_grads_params'"  # par-zero's buckets


@dataclass(frozen=True)
class State:
    """One state tensor per parameter element: its checkpoint name (``optim/<name>/...``), its dtype,
    and which params keep it: ``all``, or only the ones a matrix-wise optimizer steps as matrices
    (``matrix``) or the others (``rest``)."""

    name: str
    dtype: torch.dtype = torch.float32
    on: str = "all"

    @property
    def bytes(self) -> int:
        return self.dtype.itemsize


class Declaration:
    """What every optimizer says about itself (see the module docstring)."""

    name: ClassVar[str] = ""  # the configuration's name: [train].optimizer
    label: ClassVar[str] = ""  # its class-like name, in messages
    elementwise: ClassVar[bool] = True  # steps any flat range (False: whole matrices, or whole params)
    gathers: ClassVar[str] = "nothing"  # "matrix": each matrix it steps is gathered whole to one rank

    def state(self) -> tuple[State, ...]:
        return ()

    def kinds(self) -> tuple[str, ...]:
        """The state's names, in the order it is saved."""
        return tuple(s.name for s in self.state())

    def state_bytes(self, matrix: bool = False) -> int:
        """Bytes of state per parameter element (beside the fp32 master): of a param it steps as a matrix
        (``matrix``), or of the others."""
        return sum(s.bytes for s in self.state() if s.on in ("all", "matrix" if matrix else "rest"))

    def describe(self, matrix: bool = False) -> str:
        """The state in words (a plan's convention line)."""
        keep = [s for s in self.state() if s.on in ("all", "matrix" if matrix else "rest")]
        return ", ".join(f"{s.dtype.itemsize * 8}-bit {s.name}" for s in keep) or "no optimizer state"

    @property
    def matrix_dtype(self) -> str | None:
        """The dtype of a matrix-wise step's own arithmetic (Muon's Newton-Schulz); None for element-wise ones."""
        return None

    def torch_optimizer(self) -> tuple[type, dict] | None:
        """The ``torch.optim`` class and keywords that step the same arithmetic on whole tensors, for
        strategy 'torch_fsdp2' (torch's DTensors); None: there is none."""
        return None

    def check(self, strategy: str, weight_decay: float) -> None:
        """One ValueError line when this optimizer cannot run under ``strategy``."""
        if strategy == "torch_fsdp2" and self.torch_optimizer() is None:
            raise ValueError(f"optimizer={self.label!r} is par-zero's own, over its buckets: strategy "
                             f"{OWN_STRATEGIES}, not 'torch_fsdp2'")


class Elementwise(Declaration):
    """An optimizer whose update of an element reads only that element's param, grad and state."""

    decay: ClassVar[str] = "decoupled"  # weight decay: "decoupled" (p *= 1 - lr wd first) or "l2" (g += wd p)

    def step_(self, param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *,
              step: int, lr: float) -> None:
        """One update of the flat fp32 ``param`` in place from ``grad`` (weight decay already applied),
        ``state`` the tensors of :meth:`state` over the same range; ``step`` counts from 1."""
        raise NotImplementedError


@dataclass(frozen=True)
class AdamW(Elementwise):
    """torch.optim.AdamW's arithmetic; ``fused``: torch's fused kernel (None: where the master is on CUDA)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    fused: bool | None = None
    name: ClassVar[str] = "adamw"
    label: ClassVar[str] = "AdamW"

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))
        if not (0 <= self.betas[0] < 1 and 0 <= self.betas[1] < 1) or self.eps <= 0:
            raise ValueError(f"AdamW betas={self.betas} must lie in [0, 1), eps={self.eps} be > 0")

    def state(self):
        return State("exp_avg"), State("exp_avg_sq")

    def describe(self, matrix=False):
        return "fp32 Adam moments"

    def step_(self, param, grad, state, *, step, lr):
        adamw_step_(param, grad, state["exp_avg"], state["exp_avg_sq"], step=step, lr=lr, betas=self.betas,
                    eps=self.eps, weight_decay=0.0, fused=self.fused)

    def torch_optimizer(self):
        return torch.optim.AdamW, {"betas": self.betas, "eps": self.eps}


SGD_ARGS = ("momentum", "dampening", "nesterov")


@dataclass(frozen=True)
class SGD(Elementwise):
    """torch.optim.SGD's arithmetic (L2 weight decay added to the grad; the momentum buffer starts as the
    first step's grad); without momentum it keeps no state."""

    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    name: ClassVar[str] = "sgd"
    label: ClassVar[str] = "SGD"
    decay: ClassVar[str] = "l2"

    def __post_init__(self):
        check_optimizer(torch.optim.SGD, self._args(), 0.0)  # torch's own messages for bad values

    @classmethod
    def from_args(cls, args: dict) -> "SGD":
        unknown = set(args) - set(SGD_ARGS)
        if unknown:
            raise ValueError(f"SGD takes {', '.join(SGD_ARGS)}; not {', '.join(sorted(unknown))}")
        check_optimizer(torch.optim.SGD, args, 0.0)  # the message names the arguments as given
        return cls(**args)

    def _args(self) -> dict:
        return {"momentum": self.momentum, "dampening": self.dampening, "nesterov": self.nesterov}

    def state(self):
        return (State("momentum_buffer"),) if self.momentum else ()

    def describe(self, matrix=False):
        return "an fp32 momentum" if self.momentum else "no optimizer state"

    def step_(self, param, grad, state, *, step, lr):
        if self.momentum:
            buf = state["momentum_buffer"]
            if step == 1:
                buf.copy_(grad)
            else:
                buf.mul_(self.momentum).add_(grad, alpha=1 - self.dampening)
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        param.add_(grad, alpha=-lr)

    def torch_optimizer(self):
        return torch.optim.SGD, self._args()


@dataclass(frozen=True)
class Lion(Elementwise):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of
    ``lerp(m, g, 1 - beta1)`` times lr, then ``m = lerp(m, g, 1 - beta2)``; decoupled weight decay."""

    betas: tuple[float, float] = (0.9, 0.99)
    name: ClassVar[str] = "lion"
    label: ClassVar[str] = "Lion"

    def __post_init__(self):
        b = self.betas
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(x, (int, float)) and 0 <= x < 1
                                                                       for x in b)):
            raise ValueError(f"Lion betas={b!r} must be two numbers in [0, 1)")
        object.__setattr__(self, "betas", tuple(float(x) for x in b))

    @classmethod
    def from_args(cls, args: dict) -> "Lion":
        if set(args) - {"betas"}:
            raise ValueError(f"Lion takes betas; not {', '.join(sorted(set(args) - {'betas'}))}")
        return cls(**args)

    def state(self):
        return (State("exp_avg"),)

    def describe(self, matrix=False):
        return "an fp32 momentum"

    def step_(self, param, grad, state, *, step, lr):
        m = state["exp_avg"]
        param.add_(m.lerp(grad, 1 - self.betas[0]).sign_(), alpha=-lr)
        m.lerp_(grad, 1 - self.betas[1])


def is_matrix(name: str, param) -> bool:
    return param.dim() >= 2


def no_matrix_group(param) -> None:
    return None


@dataclass(frozen=True)
class Muon(Declaration):
    """torch.optim.Muon's arithmetic on the params ``matrices(name, param)`` names, ``adamw`` on the rest.
    Each matrix is gathered whole to one owner rank per sharding group, and over ``matrix_group(param)``
    when a model-parallel group splits it (TP); see muon.py."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_dtype: str = "bf16"
    adamw: AdamW = field(default_factory=AdamW)
    matrices: Callable = is_matrix
    matrix_group: Callable = no_matrix_group
    name: ClassVar[str] = "muon"
    label: ClassVar[str] = "Muon"
    elementwise: ClassVar[bool] = False
    gathers: ClassVar[str] = "matrix"

    def __post_init__(self):
        muon_args(self.args())

    @classmethod
    def from_args(cls, args: dict, adamw: AdamW | None = None, **callbacks) -> "Muon":
        return cls(**muon_args(args), adamw=adamw or AdamW(), **callbacks)

    def args(self) -> dict:
        """The options muon.py steps with."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in
                ("momentum", "nesterov", "ns_steps", "adjust_lr_fn", "ns_dtype")}

    def state(self):
        return State("exp_avg", on="rest"), State("exp_avg_sq", on="rest"), State("momentum_buffer", on="matrix")

    def describe(self, matrix=False):
        return "one fp32 momentum" if matrix else self.adamw.describe()

    @property
    def matrix_dtype(self):
        return self.ns_dtype


@dataclass(frozen=True)
class TorchClass(Declaration):
    """A ``torch.optim`` class (or its name) with ``args``, stepped by torch on whole params."""

    optimizer: str | type = "SGD"
    args: dict = field(default_factory=dict)
    elementwise: ClassVar[bool] = False

    @property
    def label(self) -> str:  # type: ignore[override]
        return getattr(self.optimizer, "__name__", str(self.optimizer))

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label.lower()

    def state(self):
        return self._probed

    @cached_property
    def _probed(self) -> tuple[State, ...]:
        """Probed once per declaration (a frozen dataclass: the cache sits in its ``__dict__``, not a field)."""
        return _probed_state(optimizer_class(self.optimizer), self.args)

    def torch_optimizer(self):
        return optimizer_class(self.optimizer), dict(self.args)

    def check(self, strategy, weight_decay):
        if strategy not in ("no_shard", "torch_fsdp2"):
            raise ValueError(f"optimizer={self.label!r} needs strategy 'no_shard' or 'torch_fsdp2'; "
                             f"strategy={strategy!r} shards the optimizer, which par-zero's own optimizers do "
                             f"({', '.join(d.label for d in DECLARED.values())})")
        check_optimizer(self.optimizer, self.args, weight_decay)


def _probed_state(cls: type, args: dict) -> tuple[State, ...]:
    """The state tensors one step of ``cls`` with ``args`` keeps for a small fp32 param."""
    p = torch.zeros(3, 2)
    p.grad = torch.ones(3, 2)
    opt = cls([p], lr=1e-3, **args)
    opt.step()
    return tuple(State(k, t.dtype) for k, t in sorted(opt.state[p].items()) if torch.is_tensor(t) and t.dim() > 0)


DECLARED: dict[str, type[Declaration]] = {"adamw": AdamW, "muon": Muon, "sgd": SGD, "lion": Lion}
LEGACY = {"AdamW": "adamw", "Muon": "muon"}  # the wrapper's names before declarations ('SGD' is torch's class)


def declare_optimizer(name: str | type | Declaration, args: dict | None = None, adamw: AdamW | None = None,
                      **callbacks) -> Declaration:
    """The declaration ``name`` says: a declaration (as is); par-zero's own by its configuration name
    ('adamw', 'muon', 'sgd', 'lion'; also 'AdamW', 'Muon') with ``args`` its options and ``adamw`` the AdamW
    of AdamW and of Muon's other params; or a torch.optim class or its name ('SGD', 'Adagrad', ...:
    ``args`` its keywords). ValueError for bad options."""
    args = dict(args or {})
    if isinstance(name, Declaration):
        if args:
            raise ValueError(f"optimizer_args={args} with a declared optimizer: set them in its declaration")
        return name
    own = DECLARED.get(LEGACY.get(name, name)) if isinstance(name, str) else None
    if own is AdamW:
        if args:
            raise ValueError(f"optimizer_args={args} is for a torch.optim class; AdamW takes "
                             f"betas, eps and weight_decay")
        return adamw or AdamW()
    if own is Muon:
        return Muon.from_args(args, adamw, **callbacks)
    if own is not None:
        return own.from_args(args)
    return TorchClass(name, args)
