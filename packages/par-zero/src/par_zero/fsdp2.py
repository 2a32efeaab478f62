"""The 'torch_fsdp2' strategy: torch's own fully_shard (ZeRO-3 / HSDP on a 2-D mesh) behind our API.

The explainer's alternative for users committed to the PyTorch-native stack. Its collectives
are torch's, not routed through par_groups.comm, so CommRecorder does not see them. Like
Megatron's --use-torch-fsdp2 it does not handle expert params on their own DP group.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from par_groups import comm
from par_groups.param_placement import placement_of

from .adamw import clip_coefficient
from .config import DataParallelConfig, skip_decay
from .fsdp2_state import FSDP2OptimizerState, owned_local_pieces
from .optimizer_choice import fastest_implementation, takes_weight_decay
from .units import default_unit_modules


def _mesh(dp_group: ProcessGroup, outer_group: ProcessGroup | None, device_type: str) -> DeviceMesh:
    """The (1-D, or 2-D for HSDP) mesh over our groups, of the params' device type."""
    if outer_group is None:
        return DeviceMesh.from_group(dp_group, device_type)
    # Row a of the 2-D mesh is the inner group of the rank with outer index a in our outer group.
    inner_of = [None] * dist.get_world_size()
    comm.all_gather_object(inner_of, dist.get_process_group_ranks(dp_group), None)
    rows = [inner_of[r] for r in dist.get_process_group_ranks(outer_group)]
    return DeviceMesh.from_group([outer_group, dp_group], device_type, mesh=torch.tensor(rows, dtype=torch.int), mesh_dim_names=("outer", "inner"))


def _device_type(module: nn.Module) -> str:
    types = {p.device.type for p in module.parameters()}
    if len(types) != 1:
        raise ValueError(f"torch_fsdp2 needs the module's params on one device type, got {sorted(types)}")
    return types.pop()


class TorchFSDP2:
    """fully_shard on every layer and the root, torch.optim.AdamW (or ``optimizer``: a declaration whose
    ``torch_optimizer()`` is a torch.optim class, e.g. SGD, or any torch.optim class or its name, with
    ``optimizer_args``), same methods as DataParallel."""

    def __init__(self, module: nn.Module, dp_group: ProcessGroup | None, strategy: str = "torch_fsdp2", *,
                 outer_group: ProcessGroup | None = None, outer_strategy: str = "no_shard",
                 expert_dp_group: ProcessGroup | None = None, all_gather_group: ProcessGroup | None = None,
                 bucket_mb: float = 25.0, param_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 optimizer="AdamW", optimizer_args: dict | None = None,
                 units: Iterable[nn.Module] | None = None, no_decay: Callable[[str, nn.Parameter], bool] = skip_decay):
        self.cfg = DataParallelConfig("torch_fsdp2", outer_strategy, bucket_mb, param_dtype, reduce_dtype,
                                      reshard_after_forward, lr, tuple(betas), eps, weight_decay, optimizer,
                                      dict(optimizer_args or {}))
        if self.cfg.outer_shard_optimizer:
            raise ValueError(f"torch_fsdp2 supports outer_strategy='no_shard' only, got {outer_strategy!r}")
        if any(placement_of(p).expert for p in module.parameters()):
            raise ValueError("torch_fsdp2 does not support expert params (placement expert=True); use optim_grads_params")
        self.module = module
        self.dp_group = dp_group if dp_group is not None else dist.group.WORLD
        self.lr = lr
        mesh = _mesh(self.dp_group, outer_group, _device_type(module))
        mp = None
        if param_dtype != torch.float32 or reduce_dtype is not None:
            mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype or param_dtype)
        kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward) | ({"mp_policy": mp} if mp else {})
        for m in (list(units) if units is not None else default_unit_modules(module)):
            fully_shard(m, **kw)
        fully_shard(module, **kw)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        groups = [{"params": [p for n, p in named if not no_decay(n, p)]},
                  {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0}]
        device = self.params[0].device if self.params else torch.device("cpu")
        # the declaration's torch.optim equivalent (AdamW, SGD, any torch.optim class), the mask as its two groups
        cls, args = self.cfg.declaration.torch_optimizer()
        decay = {"weight_decay": weight_decay} if takes_weight_decay(cls) else {}
        if not decay:
            groups = [{"params": groups[0]["params"] + groups[1]["params"]}]
        self.optimizer = cls(groups, lr=lr, **decay, **fastest_implementation(cls, device, args), **args)
        self.optimizer_state = FSDP2OptimizerState(self.optimizer, self.params, lambda: self.step_count)
        self.step_count = 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def set_grad_sync(self, sync: bool) -> None:
        self.module.set_requires_gradient_sync(sync)

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def step(self, after_update=None) -> None:
        """The optimizer step; ``after_update`` (as :meth:`DataParallel.step` takes it) runs after it."""
        self.step_count += 1
        self.optimizer.step()
        if after_update is not None:
            after_update()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def sum_partial_grads(self) -> int:
        """Nothing is partial: torch_fsdp2 runs with tp=1 only."""
        return 0

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_groups: Iterable[ProcessGroup] = (),
                        expert_norm_groups=None) -> torch.Tensor:
        """Global-norm clipping over the sharded grads (sum over the inner group, then norm_groups)."""
        sq = torch.zeros((), dtype=torch.float32, device=self.params[0].device if self.params else None)
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            sq += g.float().pow(2).sum()
        comm.all_reduce(sq, self.dp_group)
        for g in norm_groups:
            comm.all_reduce(sq, g)
        norm = sq.sqrt()
        coef = clip_coefficient(norm, max_norm)
        for p in self.params:
            if p.grad is not None:
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)
        return norm

    # ---- checkpoints: the pieces interface of DataParallel -------------------------------
    def owned_pieces(self, kind: str = "master") -> dict:
        """``{param: Pieces}``: this rank's rows of each trainable param ('master': fully_shard's fp32
        shard) or of its optimizer state ``kind``."""
        named = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        if kind == "master":
            return owned_local_pieces(named, lambda p: p)
        if kind not in self.optimizer_state.state_kinds():
            raise ValueError(f"kind={kind!r} is not one of master, {', '.join(self.optimizer_state.state_kinds())}")
        return owned_local_pieces(named, lambda p: self.optimizer.state[p][kind])

    def sync_params(self) -> None:
        """Nothing to re-assemble: the loaded shards are the params."""

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.module, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def model_state_bytes(self) -> dict[str, int]:
        local = lambda t: (t.to_local() if hasattr(t, "to_local") else t)
        nbytes = lambda t: local(t).numel() * local(t).element_size()
        params = sum(nbytes(p) for p in self.params)
        grads = sum(nbytes(p.grad) for p in self.params if p.grad is not None)
        optim = sum(nbytes(v) for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optim": optim, "total": params + grads + optim}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
                for n, p in self.module.named_parameters() if p.requires_grad}
