"""Which GPU kernels a run uses: chosen by ``auto`` when present, one clear error when asked for and missing.

- attention (``[model].attention_backend``): flash-attn (varlen inside every CP mode, ``flash_attn_func``
  at cp=1), else torch's SDPA (on CUDA its own flash kernel), else the pure-PyTorch kernel;
- layers (``[model].backend``): PyTorch, or Transformer Engine (``te``, CUDA);
- FP8 (``[train].fp8``): TE's delayed or current scaling recipe around each chunk's forward, or par's own
  recipes (tensorwise | rowwise | blockwise | mxfp8, ``model/fp8.py``) in the torch layers;
- MoE experts: torch's bf16 grouped GEMM when the device and torch have it (par-moe decides per call);
- AdamW: torch's fused kernel on CUDA, and on the CPU with ``[train].fused_adamw = "on"`` (par-zero decides
  per bucket).

Only this module imports the optional libraries; the rest of the trainer asks it.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from par_moe import grouped_mm_available

from ..errors import UsageError

INSTALL = {
    "flash_attn": "pip install flash-attn --no-build-isolation (CUDA only), or `uv sync --extra gpu`",
    "transformer_engine.pytorch": "pip install 'transformer-engine[pytorch]' (CUDA only), or `uv sync --extra gpu`",
}


@functools.lru_cache(maxsize=None)
def optional_module(name: str):
    """The module, or None when it is not installed or does not load (built for another torch/CUDA)."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def require(name: str, what: str):
    """The module, or a UsageError naming the setting that needs it and how to install it."""
    module = optional_module(name)
    if module is None:
        raise UsageError(f"{what} needs {name.split('.')[0]}, which is not installed or does not load "
                         f"with this torch; install it ({INSTALL[name]}) or choose another value")
    return module


@dataclass(frozen=True)
class Kernels:
    attention: str  # the par-cp backend: auto | flash | sdpa | torch
    attention_kernel: str  # what runs at cp=1 on this device (for the start-up line)
    backend: str  # torch | te
    fp8: str  # off | delayed | current (TE) | tensorwise | rowwise | blockwise | mxfp8 (par's)
    grouped_mm: bool
    fused_adamw: bool

    def describe(self) -> str:
        return (f"attention={self.attention_kernel} layers={self.backend} fp8={self.fp8} "
                f"experts={'grouped_mm' if self.grouped_mm else 'bmm'} adamw={'fused' if self.fused_adamw else 'torch'}")


def select_kernels(model_cfg, train_cfg, device: torch.device) -> Kernels:
    """Resolve the config against this device and the installed libraries (UsageError if impossible)."""
    cuda = device.type == "cuda"
    attention, backend, fp8 = model_cfg.attention_backend, model_cfg.backend, train_cfg.fp8
    flash = optional_module("flash_attn") is not None
    if attention == "flash":
        _need_cuda(device, "[model].attention_backend='flash'")
        require("flash_attn", "[model].attention_backend='flash'")
    if backend == "te":
        _need_cuda(device, "[model].backend='te'")
        require("transformer_engine.pytorch", "[model].backend='te'")
    if attention == "auto" and cuda:
        kernel = "flash" if flash else "sdpa"
    elif attention == "auto":
        kernel = "sdpa"  # torch's fused CPU kernel where a block fits it, else the pure-PyTorch one
    else:
        kernel = attention
    if backend == "te":
        kernel = "te"
    bf16 = train_cfg.resolved_dtype(device.type) == "bf16"
    fused = {"auto": cuda, "on": True, "off": False}[train_cfg.fused_adamw] and hasattr(torch, "_fused_adamw_")
    return Kernels(attention, kernel, backend, fp8, bf16 and grouped_mm_available(device), fused)


def _need_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise UsageError(f"{what} runs on CUDA only, but this run is on {device.type} "
                         f"([train].device; use the default 'auto' attention/backend on the CPU)")


def fp8_regions(kernels: Kernels, amax_group=None):
    """A function that opens TE's FP8 autocast (``[train].fp8``) for one forward of a model chunk, or
    a no-op context; the recipe is made once, here.

    One region per forward, as in Megatron: with delayed scaling TE reduces the amaxes when a region
    ends and a module may run only once inside one. ``amax_group``: the ranks that reduce them, the
    tp x dp x cp group (every rank of it holds the same layers); None would be the whole world."""
    if kernels.fp8 not in ("delayed", "current"):  # off, or par's own FP8: no region, it is in the layers
        return nullcontext
    te = require("transformer_engine.pytorch", f"[train].fp8={kernels.fp8!r}")
    recipes = importlib.import_module("transformer_engine.common.recipe")
    recipe = recipes.DelayedScaling() if kernels.fp8 == "delayed" else recipes.Float8CurrentScaling()
    if hasattr(te, "autocast"):  # newer TE; TE 2.20 deprecates fp8_autocast
        return functools.partial(te.autocast, enabled=True, recipe=recipe, amax_reduction_group=amax_group)
    return functools.partial(te.fp8_autocast, enabled=True, fp8_recipe=recipe, fp8_group=amax_group)
