"""A ``torch.optim`` class checked once on a small tensor, and the options of par-zero's Muon.

Imported by the declarations (declaration.py), hence the configuration, and the optimizers alike; it imports only
torch, so the configuration does not import the optimizers (no import circle through bucket.py).
"""

from __future__ import annotations

import inspect

import torch

from .newton_schulz import adjusted_lr


def optimizer_classes() -> list[str]:
    return sorted(n for n, c in vars(torch.optim).items()
                  if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)


def optimizer_class(optimizer: str | type) -> type[torch.optim.Optimizer]:
    """The class ``optimizer`` names (a ``torch.optim`` class name) or is; ValueError otherwise."""
    cls = getattr(torch.optim, optimizer, None) if isinstance(optimizer, str) else optimizer
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        raise ValueError(f"optimizer={optimizer!r} is not a torch.optim optimizer class; "
                         f"use one of {', '.join(optimizer_classes())} (or a torch.optim.Optimizer subclass)")
    return cls


def takes_weight_decay(cls: type) -> bool:
    return "weight_decay" in inspect.signature(cls.__init__).parameters


def check_optimizer(optimizer: str | type, args: dict, weight_decay: float) -> type[torch.optim.Optimizer]:
    """The class, after one step on a small tensor: bad arguments, a class that needs a closure or
    sparse grads, or state not shaped like its param (not cut into pieces) raise one ValueError line."""
    cls = optimizer_class(optimizer)
    name = getattr(cls, "__name__", repr(cls))
    for key in ("lr", "weight_decay", "params"):
        if key in args:
            raise ValueError(f"optimizer_args sets {key!r}: it is the wrapper's own argument (lr, weight_decay)")
    if weight_decay and not takes_weight_decay(cls):
        raise ValueError(f"optimizer {name} takes no weight_decay; set weight_decay to 0")
    p = torch.zeros(3, 2)
    p.grad = torch.ones(3, 2)
    try:
        opt = cls([p], lr=1e-3, **args, **({"weight_decay": weight_decay} if weight_decay else {}))
        opt.step()
    except Exception as e:  # noqa: BLE001 -- whatever torch refuses, in one line
        raise ValueError(f"optimizer {name} with {args}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    for key, t in opt.state[p].items():
        if torch.is_tensor(t) and t.dim() > 0 and t.shape != p.shape:
            raise ValueError(f"optimizer {name} keeps state {key!r} not shaped like its param "
                             f"({list(t.shape)} for {list(p.shape)}): only elementwise state is saved as pieces")
    return cls


def fastest_implementation(cls: type, device: torch.device, args: dict | None = None) -> dict:
    """The keyword that selects ``cls``'s fastest kernels on ``device``: ``fused=True`` on an accelerator
    (CUDA, ...) where the class has a fused kernel, else ``foreach=True`` there; nothing on the CPU
    (torch's default there is the per-tensor loop, which these results are measured against) or when
    ``args`` already choose (``fused`` / ``foreach`` in ``[train].optimizer_args``)."""
    params = inspect.signature(cls.__init__).parameters
    if torch.device(device).type == "cpu" or {"fused", "foreach"} & set(args or {}):
        return {}
    if "fused" in params and torch.device(device).type in _fused_devices():
        return {"fused": True}
    return {"foreach": True} if "foreach" in params else {}


def _fused_devices() -> list[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return _get_fused_kernels_supported_devices()


NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MUON_ARGS = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "adjust_lr_fn": None, "ns_dtype": "bf16"}


def muon_args(args: dict) -> dict:
    """``args`` over MUON_ARGS' defaults; ValueError naming what is wrong."""
    unknown = set(args) - set(MUON_ARGS)
    if unknown:
        raise ValueError(f"Muon takes {', '.join(MUON_ARGS)}; not {', '.join(sorted(unknown))}")
    out = MUON_ARGS | args
    if not 0 <= out["momentum"] < 1 or not 1 <= out["ns_steps"] < 100 or out["ns_dtype"] not in NS_DTYPES:
        raise ValueError(f"Muon momentum={out['momentum']} must be in [0, 1), ns_steps={out['ns_steps']} in 1..99, "
                         f"ns_dtype={out['ns_dtype']!r} one of {', '.join(NS_DTYPES)}")
    adjusted_lr(1.0, out["adjust_lr_fn"], (2, 1))  # raises on an unknown name
    return out
