"""The data-parallel wrapper: DDP, ZeRO-1/2/3 and HSDP over flat bucketed buffers, with its optimizer.

It composes the gradient/parameter buffer (grad_buffer.py: buckets, hooks, collectives), the
optimizer its declaration names, in the loop for its kind (declaration.py, optimizer_loops.py; optimizer.py: AdamW over each rank's range;
elementwise.py: any element-wise declaration, SGD, Lion; muon.py; torch_optimizer.py: any
torch.optim class when each rank holds whole params) and the clipping function
(clipping.py). :func:`data_parallel` picks the implementation for a strategy ('torch_fsdp2' is
torch's fully_shard, fsdp2.py).

Usage (the trainer's loop)::

    dp = data_parallel(model, groups.dp_cp, "optim_grads", expert_dp_group=groups.edp, lr=3e-4)
    for micro in range(n):
        with dp.no_sync() if micro < n - 1 else nullcontext():
            loss = loss_fn(dp(x[micro])) / n   # per-rank mean; DP averages it
            loss.backward()
    dp.sum_partial_grads()      # grads whose placement says partial over model-parallel copies
    dp.clip_grad_norm_(1.0, norm_groups=(groups.tp, groups.pp))
    dp.set_lr(lr_schedule(step)); dp.step(); dp.zero_grad()

Gradients are AVERAGED over the data-parallel ranks (dp_group x outer_group; dp_group may be dp x
cp).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .bucket import Bucket
from .bucket_groups import BucketGroups
from .checkpoint import buddy_pieces, gather_full_state, load_sharded_state_dict, owned_pieces, sharded_state_dict
from .clipping import clip_grad_norm_
from .config import DataParallelConfig, skip_decay
from .declaration import AdamW, Declaration, declare_optimizer
from .fsdp2 import TorchFSDP2
from .grad_buffer import GradBuffer
from .optimizer_loops import buddy_loop, optimizer_loop


def data_parallel(module: nn.Module, dp_group: ProcessGroup | None, strategy: str = "no_shard",
                  **kwargs) -> "DataParallel | TorchFSDP2":
    """Wrap ``module`` for ``strategy``: a :class:`TorchFSDP2` for 'torch_fsdp2', else a
    :class:`DataParallel` (same methods; keyword arguments as :class:`DataParallel`)."""
    cls = TorchFSDP2 if strategy == "torch_fsdp2" else DataParallel
    return cls(module, dp_group, strategy, **kwargs)


class DataParallel:
    """Wrap ``module`` for data parallelism with ``strategy`` and own its optimizer.

    Strategies: 'no_shard' (DDP), 'optim' (ZeRO-1), 'optim_grads' (ZeRO-2), 'optim_grads_params'
    (ZeRO-3); for 'torch_fsdp2' use :func:`data_parallel`.
    HSDP: ``dp_group`` is the inner sharding group, ``outer_group`` the replicas, with
    ``outer_strategy`` 'no_shard' or 'optim' (the latter only with ZeRO-3). Params whose
    placement (``par_groups.placement_of``) says ``expert`` are data-parallel over
    ``expert_dp_group`` (under HSDP: sharded over it, replicated over ``expert_outer_group``);
    frozen params are skipped. Weight decay skips the params for which
    ``no_decay(name, param)`` holds (default: 1-D ones, i.e. norms and biases). Each param of
    ``own_bucket`` gets a bucket of its own, so ranks holding different other params shard it
    alike (Megatron's shared embedding on the first and last pipeline stage).

    ``overlap_comm``: True launches ZeRO-3's next gather before the current unit's compute and
    lets a reduction run while the next bucket's grads arrive; False holds fewer buffers at the
    peak (gathers once the current unit is freed, a bucket's grads once the reductions in flight
    leave room). None (default): True, except for params on the CPU, where gloo runs collectives
    on the compute's cores and stages each gathered output in a second buffer of its size.

    ``gathered_as``: ``{param: gather(shard, group)}`` for ZeRO-3 params gathered in another form than
    their values (par_tp.fp8's FP8 parameter gather): each gets a bucket of its own whose shard is whole
    rows of it; its unit runs ``gather`` on the rows this rank holds where it would all-gather the
    values, and sets what it returns as the param's ``zero3_gathered`` (None once released). The
    param's values are then never gathered: only a module that reads ``zero3_gathered`` may use it.

    ``buddy_shards=1`` (ZeRO-1/2/3 over the whole group; buddy.py): rank ``i`` also steps shard ``(i + buddy_stride)
    % d`` of each dense bucket, a live copy on another replica where a replica is ``buddy_stride`` consecutive ranks
    of ``dp_group`` (expert parallelism: an expert-parallel group); of an expert bucket shard ``(i + expert_buddy_stride)
    % d`` of ``expert_dp_group``, a replica being that many consecutive ranks of it (more than one where an expert-
    parallel group spans a replica's context-parallel ranks only).

    ``optimizer``: one declaration (declaration.py), which says its state, how it steps and what it
    gathers: ``AdamW(betas, eps, fused)``, ``SGD(momentum, dampening, nesterov)``, ``Lion(betas)`` (element-
    wise: every strategy steps its shard), ``Muon(..., adamw=AdamW(...), matrices=, matrix_group=)`` (each
    matrix gathered whole over the sharding group and ``matrix_group(param)``, the group splitting it;
    see muon.py), or ``TorchClass(cls, args)``: a ``torch.optim`` class on whole params, 'no_shard' only,
    built with ``lr``, ``weight_decay`` (on the decayed group) and ``args``. The names before
    declarations still work: 'AdamW' (``betas``, ``eps``, ``fused_adamw``), 'Muon' (``optimizer_args``,
    ``muon_params``, ``matrix_group``), a torch.optim class or its name (``optimizer_args``).
    """

    def __init__(
        self,
        module: nn.Module,
        dp_group: ProcessGroup | None,
        strategy: str = "no_shard",
        *,
        outer_group: ProcessGroup | None = None,
        outer_strategy: str = "no_shard",
        expert_dp_group: ProcessGroup | None = None,
        expert_outer_group: ProcessGroup | None = None,
        all_gather_group: ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        optimizer: Declaration | str | type = "AdamW",
        optimizer_args: dict | None = None,
        units: Iterable[nn.Module] | None = None,
        no_decay: Callable[[str, nn.Parameter], bool] = skip_decay,
        own_bucket: Iterable[nn.Parameter] = (),
        overlap_comm: bool | None = None,
        muon_params: Callable[[str, nn.Parameter], bool] | None = None,
        matrix_group: Callable[[nn.Parameter], ProcessGroup | None] | None = None,
        fused_adamw: bool | None = None,
        gathered_as: dict | None = None,
        buddy_shards: int = 0,
        buddy_stride: int = 1,
        expert_buddy_stride: int = 1,
    ):
        if optimizer == "Muon":  # the name before declarations, with its callbacks as keywords
            callbacks = {"matrices": muon_params, "matrix_group": matrix_group}
            optimizer = declare_optimizer("Muon", optimizer_args, AdamW(betas, eps, fused_adamw),
                                          **{k: f for k, f in callbacks.items() if f is not None})
            optimizer_args = None
        elif muon_params is not None or matrix_group is not None:
            raise ValueError("muon_params and matrix_group go with optimizer='Muon'; a Muon declaration holds "
                             "them as matrices= and matrix_group=")
        self.cfg = cfg = DataParallelConfig(strategy, outer_strategy, bucket_mb, param_dtype, reduce_dtype,
                                            reshard_after_forward, lr, tuple(betas), eps, weight_decay,
                                            optimizer, dict(optimizer_args or {}), overlap_comm, fused_adamw, buddy_shards)
        if cfg.torch_native:
            raise ValueError("strategy='torch_fsdp2' is torch's fully_shard: build it with "
                             "par_zero.data_parallel(...) (or TorchFSDP2), not DataParallel")
        cfg.check_outer(outer_group is not None or expert_outer_group is not None)
        self.module = module
        self.param_names = {p: n for n, p in module.named_parameters()}
        with torch.no_grad():  # frozen params compute in param_dtype too (and are not trained)
            for p in module.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(param_dtype)
        dense = BucketGroups(dp_group, outer_group, all_gather_group, buddy_stride)
        expert = BucketGroups(expert_dp_group, expert_outer_group, buddy_stride=expert_buddy_stride) \
            if expert_dp_group is not None else dense
        if gathered_as and not cfg.shard_params:
            raise ValueError(f"gathered_as names params ZeRO-3 gathers: strategy={strategy!r} gathers none; "
                             f"use 'optim_grads_params'")
        self.buffer = GradBuffer(module, cfg, dense, expert, units, own_bucket, gathered_as)
        decayed = lambda p: not no_decay(self.param_names[p], p)  # noqa: E731
        self.optimizer = optimizer_loop(cfg.declaration, self.buffer.buckets, cfg, decayed, self.param_names.__getitem__)
        # buddy_shards: the same optimizer over the next rank's ranges (buddy.py); None without them
        # with buddies, True: :meth:`step` leaves the params' gather to the caller's :meth:`sync_params`
        # (``params_stale`` until then), so a peer lost in it finds this rank's update whole
        self.defer_param_sync, self.params_stale = False, False
        buddies = self.buffer.buddies
        self.buddy_optimizer = buddy_loop(cfg.declaration, buddies, cfg, decayed,
                                          self.param_names.__getitem__) if buddies else None

    @property
    def buckets(self) -> list[Bucket]:
        return self.buffer.buckets

    @property
    def optimizer_state(self):
        """The optimizer's checkpoint interface (state kinds, scalars, load hooks), as TorchFSDP2's."""
        return self.optimizer

    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    @step_count.setter
    def step_count(self, n: int) -> None:  # restored from a checkpoint
        self.optimizer.step_count = n
        if self.buddy_optimizer is not None:
            self.buddy_optimizer.step_count = n

    # ---- forward / backward ----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.cfg.param_dtype != torch.float32:
            cast = lambda t: t.to(self.cfg.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    forward = __call__

    def no_sync(self):
        """Backwards inside only accumulate grads locally (no communication); the next synced
        backward reduces the sum."""
        return self.buffer.no_sync()

    def set_grad_sync(self, sync: bool) -> None:
        """Same as ``no_sync`` for callers (pipeline executors) that cannot use a context."""
        self.buffer.set_grad_sync(sync)

    def reduce_grads(self) -> None:
        """Reduce now what backwards under ``no_sync`` accumulated (see :meth:`GradBuffer.reduce_grads`)."""
        self.buffer.reduce_grads()

    def sum_partial_grads(self) -> int:
        """Sum the grads partial over model-parallel copies (see :meth:`GradBuffer.sum_partial_grads`)."""
        return self.buffer.sum_partial_grads()

    def clip_grad_norm_(self, max_norm: float, norm_groups: Iterable[ProcessGroup] = (),
                        expert_norm_groups: Iterable[ProcessGroup] | None = None) -> torch.Tensor:
        """Clip to a global norm of ``max_norm`` and return the norm (see :func:`par_zero.clip_grad_norm_`)."""
        return clip_grad_norm_(self.buffer, max_norm, norm_groups, expert_norm_groups)

    # ---- optimizer -----------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        self.optimizer.set_lr(lr)
        if self.buddy_optimizer is not None:
            self.buddy_optimizer.set_lr(lr)

    def zero_grad(self) -> None:
        self.buffer.zero_grad()

    def step(self, after_update: Callable[[], None] | None = None) -> None:
        """The optimizer on each rank's range, then re-assemble the params (all-gather where sharded).
        ``after_update``: run between the two (e.g. :meth:`scale_rows_` of the updated weights).
        Buddy ranges step before the gather, which brings their owners' (equal) update: an element-wise one first, a
        matrix-wise one (Muon) after the owned step, whose collectives leave it its update (muon_buddy.py)."""
        buddy = self.buddy_optimizer
        first = buddy is not None and self.cfg.declaration.elementwise
        if buddy is not None:
            buddy.step_count = self.optimizer.step_count
            if first:
                buddy.step()
            if self.defer_param_sync:  # the update is whole on this rank before any collective
                self.optimizer.step()
                if not first:
                    buddy.step()
                if after_update is not None:
                    after_update()
                self.params_stale = True
                return
        if self.cfg.declaration.elementwise and after_update is None:  # gathers overlap the next updates
            self.buffer.sync_params(self.optimizer.step)
        else:
            self.optimizer.step()
            if buddy is not None and not first:
                buddy.step()
            if after_update is not None:
                after_update()
            self.buffer.sync_params()

    @torch.no_grad()
    def scale_rows_(self, scales: dict[nn.Parameter, torch.Tensor]) -> None:
        """Multiply each row ``i`` (dim 0 of the local param) of ``p`` by ``scales[p][i]``, on this rank's
        optimizer range of its fp32 master; the params follow at the next re-assembly (:meth:`step`)."""
        for b in self.buckets:
            for p, _, lo, hi, p_lo in b.opt_segments():
                if p in scales:
                    row = torch.arange(p_lo, p_lo + hi - lo, device=b.master.device) // (p.numel() // p.shape[0])
                    b.master[lo:hi].mul_(scales[p].to(b.master.dtype)[row])

    def sync_params(self) -> None:
        """Re-assemble the params from each rank's optimizer range (after a step or a load)."""
        self.buffer.sync_params()
        self.params_stale = False

    # ---- checkpoints ---------------------------------------------------------------------
    def owned_pieces(self, kind: str = "master") -> dict:
        """``{param: Pieces}``: the boxes of each param's full tensor this rank owns (views; see checkpoint.py)."""
        return owned_pieces(self, kind)

    def buddy_pieces(self, kind: str = "master") -> dict:
        """``{param: Pieces}``: as :meth:`owned_pieces`, the buddy shard's boxes (none without buddy_shards)."""
        return buddy_pieces(self, kind)

    def state_dict(self, kinds: Iterable[str] | None = None, scalars: Iterable[str] = ()) -> dict:
        """This rank's pieces of the model and optimizer state, for ``par_zero.save_pieces`` / ``load_pieces``.

        To load into a fresh torch.optim optimizer (its state appears at its first step), name the
        checkpoint's state ``kinds`` and ``scalars`` (``optim/<kind>/...``, ``optim/scalar/<name>``)."""
        return sharded_state_dict(self, kinds, scalars)

    def load_state_dict(self, sd: dict) -> None:
        """After ``load_pieces`` filled our ``state_dict()`` (views of the buffers): step count, then params."""
        load_sharded_state_dict(self, sd)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable param, gathered in fp32 from the masters (for tests and export)."""
        return gather_full_state(self, "master")

    def full_state(self, kind: str = "master") -> dict[str, torch.Tensor]:
        """Gather ``kind`` ('master' or one of ``optimizer.state_kinds()``) of every trainable param, full size."""
        return gather_full_state(self, kind)

    # ---- introspection -------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The persistent tensors this rank holds, by kind: 'params', 'grads', 'optim' (fp32 masters
        and the optimizer's declared state)."""
        held = {kind: [t for b in self.buckets for t in b.state_tensors()[kind]]
                for kind in ("params", "grads", "optim")}
        held["optim"] += self.optimizer.state_tensors()
        if self.buddy_optimizer is not None:
            held["optim"] += self.buddy_optimizer.state_tensors()
        return held

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in params, grads and optimizer state (distinct storages)."""
        held = self.state_tensors()
        out = {}
        seen: set[int] = set()
        for kind, tensors in held.items():
            total = 0
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                if st.data_ptr() in seen or st.nbytes() == 0:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
            out[kind] = total
        out["total"] = out["params"] + out["grads"] + out["optim"]
        return out
