"""The data-parallel strategy names and the validated configuration of one wrapper."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .declaration import AdamW, Declaration, declare_optimizer

# Megatron's --data-parallel-sharding-strategy names, plus torch's own FSDP2 as an alternative.
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params", "torch_fsdp2")
OUTER_STRATEGIES = ("no_shard", "optim")
SHARDED = ("optim", "optim_grads", "optim_grads_params")


def skip_decay(name: str, param: torch.nn.Parameter) -> bool:
    """The default weight-decay mask (nanoGPT's, Megatron's): no decay on 1-D params, i.e. norms and biases."""
    return param.dim() < 2


@dataclass(frozen=True)
class DataParallelConfig:
    """What to shard, how to bucket and cast, and the AdamW hyper-parameters."""

    strategy: str = "no_shard"
    outer_strategy: str = "no_shard"
    bucket_mb: float = 25.0
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # a declaration (declaration.py: AdamW, Muon, SGD, Lion; every strategy), or what declare_optimizer
    # reads as one: par-zero's own by name ('AdamW' with betas, eps, fused_adamw; 'Muon' with these
    # keyword arguments), or a torch.optim class or its name (unsharded strategies), built with lr,
    # weight_decay and these keyword arguments
    optimizer: str | type | Declaration = "AdamW"
    optimizer_args: dict = field(default_factory=dict)
    # Overlap communication with compute at the cost of holding its buffers (grad_buffer.py);
    # None: on, except when the params are on the CPU (gloo: little overlap, staged gathers)
    overlap_comm: bool | None = None
    # AdamW's update: torch's fused kernel (None: where the master lives on CUDA; True: on the CPU
    # too, faster there than the explicit ops but not bitwise torch's foreach=False; False: never)
    fused_adamw: bool | None = None
    # 1: ZeRO-1, 2 or 3 (par's own: 'optim', 'optim_grads', 'optim_grads_params'), an element-wise optimizer: each
    # rank also steps the next rank's shard (buddy.py)
    buddy_shards: int = 0
    # The strategy, parsed once (in __post_init__) into what it shards; the rest reads these.
    shard_optimizer: bool = field(init=False)  # ZeRO-1 and up: each rank steps its range only
    shard_grads: bool = field(init=False)  # ZeRO-2 and up: only the reduced shard of the grads is kept
    shard_params: bool = field(init=False)  # ZeRO-3: params at rest are a shard, gathered per unit
    outer_shard_optimizer: bool = field(init=False)  # HSDP outer 'optim': the range split over replicas too
    torch_native: bool = field(init=False)  # 'torch_fsdp2': torch's fully_shard does all of it
    declaration: Declaration = field(init=False)  # the optimizer, declared (betas, eps, fused_adamw: its AdamW's)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if self.outer_strategy not in OUTER_STRATEGIES:
            raise ValueError(f"outer_strategy={self.outer_strategy!r} is not one of {OUTER_STRATEGIES}")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb={self.bucket_mb} must be > 0")
        for name in ("param_dtype", "reduce_dtype"):
            dt = getattr(self, name)
            if dt is not None and dt not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"{name}={dt} must be torch.float32, torch.bfloat16 or torch.float16")
        if not (0 <= self.betas[0] < 1 and 0 <= self.betas[1] < 1):
            raise ValueError(f"betas={self.betas} must lie in [0, 1)")
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"lr={self.lr}, eps={self.eps}, weight_decay={self.weight_decay}: need lr >= 0, eps > 0, wd >= 0")
        self._check_optimizer()
        if self.buddy_shards not in (0, 1) or self.buddy_shards and (self.strategy not in SHARDED
                                                                       or not (self.declaration.elementwise
                                                                               or self.declaration.gathers == "matrix")):
            raise ValueError(f"buddy_shards={self.buddy_shards} must be 0, or 1 with strategy 'optim', 'optim_grads' or "
                             f"'optim_grads_params' and an element-wise optimizer or Muon (got strategy={self.strategy!r}, "
                             f"optimizer={self.declaration.label!r})")
        level = STRATEGIES.index(self.strategy)  # no_shard < optim < optim_grads < optim_grads_params < torch_fsdp2
        for name, value in (("shard_optimizer", level >= 1), ("shard_grads", level >= 2), ("shard_params", level >= 3),
                            ("outer_shard_optimizer", self.outer_strategy == "optim"),
                            ("torch_native", self.strategy == "torch_fsdp2")):
            object.__setattr__(self, name, value)

    def _check_optimizer(self) -> None:
        decl = check_optimizer_choice(self.strategy, self.optimizer, self.optimizer_args, self.weight_decay,
                                      AdamW(self.betas, self.eps, self.fused_adamw))
        object.__setattr__(self, "declaration", decl)
        adamw = decl if isinstance(decl, AdamW) else getattr(decl, "adamw", None)
        if adamw is not None:  # a declared AdamW's hyper-parameters are the ones in force
            for name, value in (("betas", adamw.betas), ("eps", adamw.eps), ("fused_adamw", adamw.fused)):
                object.__setattr__(self, name, value)

    @property
    def grad_dtype(self) -> torch.dtype:
        """Grads are kept (accumulated and reduced) in reduce_dtype when given, else param_dtype."""
        return self.reduce_dtype or self.param_dtype

    def check_outer(self, has_outer: bool) -> None:
        if not has_outer:
            return
        if self.buddy_shards:
            raise ValueError("buddy_shards=1 shards over the whole dp group: not with an outer (HSDP replica) group")
        if not self.shard_optimizer:
            raise ValueError(
                f"an outer (HSDP replica) group needs a sharded inner strategy, got strategy={self.strategy!r}; "
                f"use one of {SHARDED + ('torch_fsdp2',)}, or pass one dp group for plain DDP"
            )
        if self.outer_shard_optimizer and self.declaration.gathers == "matrix":
            raise ValueError(f"optimizer={self.declaration.label!r} gathers each matrix over the inner sharding group: "
                             f"not with outer_strategy='optim' (use outer_strategy='no_shard')")
        if self.outer_shard_optimizer and not (self.shard_params and not self.torch_native):
            raise ValueError(
                f"outer_strategy='optim' is only valid with strategy='optim_grads_params', got {self.strategy!r}"
            )


def check_optimizer_choice(strategy: str, optimizer, optimizer_args: dict, weight_decay: float,
                           adamw: AdamW | None = None) -> Declaration:
    """The declaration of ``optimizer`` (see :func:`declare_optimizer`), after one ValueError line when it
    cannot run under ``strategy`` with these arguments: the declaration's own check."""
    decl = declare_optimizer(optimizer, optimizer_args, adamw)
    decl.check(strategy, weight_decay)
    return decl
