"""The data-parallel wrapper: DDP, ZeRO-1/2/3 and HSDP over flat bucketed buffers, with AdamW.

Usage (the trainer's loop)::

    dp = DataParallel(model, groups.dp_cp, "optim_grads", expert_dp_group=groups.edp, lr=3e-4)
    for micro in range(n):
        with dp.no_sync() if micro < n - 1 else nullcontext():
            loss = loss_fn(dp(x[micro])) / n   # per-rank mean; DP averages it
            loss.backward()
    dp.sum_partial_grads()      # grads whose placement says partial over model-parallel copies
    dp.clip_grad_norm_(1.0, norm_groups=(groups.tp, groups.pp))
    dp.set_lr(lr_schedule(step)); dp.step(); dp.zero_grad()

Gradients are AVERAGED over the data-parallel ranks (dp_group x outer_group; dp_group may be dp x
cp). Grad reductions start from backward hooks as each bucket fills and are awaited at the end of
that backward; under ``no_sync()`` grads only accumulate locally, with no communication.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from par_groups import comm
from par_groups.param_placement import placement_of, sum_partial_grads_

from .adamw import clip_coefficient
from .bucket import Bucket, BucketGroups
from .checkpoint import load_sharded_state_dict, owned_pieces, sharded_state_dict
from .config import DataParallelConfig, skip_decay
from .units import GatherUnit, default_unit_modules


MAX_INFLIGHT = 1  # bucket reductions left in flight when the next launches (bounds ZeRO-2/3 full grads)


def _size_buckets(params: list[nn.Parameter], bucket_bytes: int, alone=frozenset()) -> list[list[nn.Parameter]]:
    """Split params, in grad-ready order (reverse of registration), into buckets of ~bucket_bytes;
    each param in ``alone`` gets a bucket of its own."""
    buckets, cur, size = [], [], 0
    for p in reversed(params):
        if p in alone:
            buckets += ([cur] if cur else []) + [[p]]
            cur, size = [], 0
            continue
        cur.append(p)
        size += p.numel() * 4
        if size >= bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def _apart(params: list[nn.Parameter], alone) -> list[list[nn.Parameter]]:
    """``params`` as one bucket, less those in ``alone``, which get one each."""
    rest = [p for p in params if p not in alone]
    return [[p] for p in params if p in alone] + ([rest] if rest else [])


class DataParallel:
    """Wrap ``module`` for data parallelism with ``strategy`` and own its AdamW optimizer.

    Strategies: 'no_shard' (DDP), 'optim' (ZeRO-1), 'optim_grads' (ZeRO-2), 'optim_grads_params'
    (ZeRO-3), 'torch_fsdp2' (delegates to torch's fully_shard; returns a :class:`TorchFSDP2`).
    HSDP: ``dp_group`` is the inner sharding group, ``outer_group`` the replicas, with
    ``outer_strategy`` 'no_shard' or 'optim' (the latter only with ZeRO-3). Params whose
    placement (``par_groups.placement_of``) says ``expert`` are data-parallel over
    ``expert_dp_group``; frozen params are skipped. Weight decay skips the params for which
    ``no_decay(name, param)`` holds (default: 1-D ones, i.e. norms and biases). Each param of
    ``own_bucket`` gets a bucket of its own, so ranks holding different other params still shard
    it alike (Megatron's shared embedding on the first and last pipeline stage: its copies' grads
    are summed shard by shard in :meth:`sum_partial_grads`).
    """

    def __new__(cls, module: nn.Module, dp_group: ProcessGroup | None, strategy: str = "no_shard", **kwargs):
        if cls is DataParallel and strategy == "torch_fsdp2":
            from .fsdp2 import TorchFSDP2

            return TorchFSDP2(module, dp_group, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        dp_group: ProcessGroup | None,
        strategy: str = "no_shard",
        *,
        outer_group: ProcessGroup | None = None,
        outer_strategy: str = "no_shard",
        expert_dp_group: ProcessGroup | None = None,
        all_gather_group: ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        param_dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype | None = None,
        reshard_after_forward: bool = True,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        units: Iterable[nn.Module] | None = None,
        no_decay: Callable[[str, nn.Parameter], bool] = skip_decay,
        own_bucket: Iterable[nn.Parameter] = (),
    ):
        self.cfg = cfg = DataParallelConfig(strategy, outer_strategy, bucket_mb, param_dtype, reduce_dtype,
                                            reshard_after_forward, lr, tuple(betas), eps, weight_decay)
        cfg.check_outer(outer_group is not None)
        self.module = module
        self.lr = lr
        self.step_count = 0
        self._sync = True
        self._callback_queued = False
        self._inflight: list[Bucket] = []
        self.dense_groups = BucketGroups(dp_group, outer_group, all_gather_group)
        self.expert_groups = BucketGroups(expert_dp_group) if expert_dp_group is not None else self.dense_groups
        self.param_names = {p: n for n, p in module.named_parameters()}
        trainable = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():  # frozen params compute in param_dtype too (and are not trained)
            for p in module.parameters():
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(param_dtype)

        def family(ps):  # split params into (dense, expert) with their groups
            dense = [p for p in ps if not placement_of(p).expert]
            expert = [p for p in ps if placement_of(p).expert]
            return [(dense, self.dense_groups), (expert, self.expert_groups)]

        self.buckets: list[Bucket] = []
        self.units: list[GatherUnit] = []
        self._hooks = []
        alone = frozenset(own_bucket)
        if strategy == "optim_grads_params":
            self._build_units(module, trainable, family, units, alone)
        else:
            bucket_bytes = int(bucket_mb * 2**20)
            for ps, groups in family(trainable):
                for chunk in _size_buckets(ps, bucket_bytes, alone):
                    self.buckets.append(Bucket(chunk, groups, cfg))
        for b in self.buckets:
            b.set_decay(lambda p: not no_decay(self.param_names[p], p))
        self._where = {p: (b, k) for b in self.buckets for k, p in enumerate(b.params)}
        for p in self._where:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _build_units(self, module, trainable, family, unit_modules, alone) -> None:
        taken: set[nn.Parameter] = set()
        owned = set(trainable)
        plan: list[tuple[nn.Module, list[nn.Parameter]]] = []
        for m in (list(unit_modules) if unit_modules is not None else default_unit_modules(module)):
            ps = [p for p in m.parameters() if p in owned and p not in taken]
            taken.update(ps)
            if ps:
                plan.append((m, ps))
        rest = [p for p in trainable if p not in taken]
        for m, ps in plan + ([(module, rest)] if rest else []):
            bs = [Bucket(part, groups, self.cfg) for fam, groups in family(ps) if fam for part in _apart(fam, alone)]
            self.buckets.extend(bs)
            is_root = m is module
            unit = GatherUnit(m, bs, self.cfg.reshard_after_forward and not is_root)
            self._hooks.extend(unit.install(is_root))
            self.units.append(unit)
        for a, b in zip(self.units, self.units[1:]):
            a.next, b.prev = b, a

    # ---- forward / backward ----------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.cfg.param_dtype != torch.float32:
            cast = lambda t: t.to(self.cfg.param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    forward = __call__

    @contextmanager
    def no_sync(self):
        """Backwards inside only accumulate grads locally (no communication); the next synced
        backward reduces the sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def set_grad_sync(self, sync: bool) -> None:
        """Same as ``no_sync`` for callers (pipeline executors) that cannot use a context."""
        self._sync = sync

    def reduce_grads(self) -> None:
        """Reduce now what backwards under ``no_sync`` accumulated, e.g. after a pipeline schedule
        whose last backward (a zero-bubble W) is not known in advance; sync is on afterwards."""
        self._sync = True
        self._end_of_backward()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket, k = self._where[p]
        bucket.accumulate(k, p.grad)
        p.grad = None
        bucket.pending -= 1
        if bucket.pending == 0:
            if self._sync:
                self._launch(bucket)
            bucket.reshard()

    def _launch(self, bucket: Bucket) -> None:
        """Start a bucket's reduction; retire finished ones (freeing ZeRO-2/3 full grads early)
        and keep at most MAX_INFLIGHT in flight."""
        bucket.launch_reduce()
        self._inflight.append(bucket)
        while self._inflight and self._inflight[0].try_finish(block=len(self._inflight) > MAX_INFLIGHT):
            self._inflight.pop(0)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._sync:
            for b in self.buckets:  # buckets with unused params: reduce what they have (all ranks alike)
                if b.pending != 0:
                    if b.full_grad is None:
                        b.new_full_grad()
                    b.launch_reduce()
                    self._inflight.append(b)
            for b in self._inflight:
                b.try_finish(block=True)
            self._inflight.clear()
        for b in self.buckets:
            b.pending = len(b.params)
            b.reshard()

    # ---- optimizer -----------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on each rank's shard, then re-assemble the params (all-gather where sharded)."""
        self.step_count += 1
        for b in self.buckets:
            b.optimizer_step(self.step_count, self.lr)
        self.sync_params()

    @torch.no_grad()
    def sync_params(self) -> None:
        """Re-assemble the params from each rank's optimizer range (after a step or a load)."""
        works = [b.launch_param_sync() for b in self.buckets]
        for w in works:
            if w is not None:
                w.wait()

    @torch.no_grad()
    def sum_partial_grads(self) -> int:
        """After the reduction: sum the grads whose placement is partial over model-parallel copies
        (sequence-parallel norms, replicated KV heads), in this rank's optimizer range. Sums are
        linear, so after the DP mean is as good as before it; copies hold identical buckets, so the
        ranges line up. Returns how many param pieces were summed."""
        items = [(b.opt_grad[lo:hi], placement_of(p)) for b in self.buckets
                 for p, _, lo, hi, _ in b.opt_segments() if placement_of(p).needs_grad_sum()]
        return sum_partial_grads_(items)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_groups: Iterable[ProcessGroup] = (),
                        expert_norm_groups: Iterable[ProcessGroup] | None = None) -> torch.Tensor:
        """Scale all grads so their global L2 norm is at most ``max_norm``; return the norm.

        The squared norm is summed over this wrapper's shards, then over each of ``norm_groups``
        (the model-parallel groups holding other parts of the model: tp, pp, ...); expert params
        over ``expert_norm_groups`` (default: ``norm_groups``). A param with model-parallel copies
        counts on the first copy only (its placement says which), so each element counts once."""
        norm_groups = tuple(norm_groups)
        expert_norm_groups = norm_groups if expert_norm_groups is None else tuple(expert_norm_groups)
        device = self.buckets[0].device if self.buckets else None
        total = torch.zeros((), dtype=torch.float32, device=device)
        for groups, extra in ((self.dense_groups, norm_groups), (self.expert_groups, expert_norm_groups)):
            fam = [b for b in self.buckets if b.groups is groups]
            if not fam:
                continue
            sq = torch.zeros((), dtype=torch.float32, device=device)
            for b in fam:
                for p, _, lo, hi, _ in b.opt_segments():
                    if placement_of(p).counted():
                        sq += b.opt_grad[lo:hi].float().pow(2).sum()
            if self.cfg.strategy != "no_shard":
                comm.all_reduce(sq, groups.inner)
                if fam[0].outer_optim:
                    comm.all_reduce(sq, groups.outer)
            for g in extra:
                comm.all_reduce(sq, g)
            total += sq
            if self.expert_groups is self.dense_groups:
                break
        norm = total.sqrt()
        coef = clip_coefficient(norm, max_norm)
        for b in self.buckets:
            b.opt_grad.mul_(coef)
        return norm

    # ---- checkpoints ---------------------------------------------------------------------
    def owned_pieces(self, kind: str = "master") -> dict:
        """``{param: Pieces}``: the boxes of each param's full tensor this rank owns (views; see checkpoint.py)."""
        return owned_pieces(self, kind)

    def state_dict(self) -> dict:
        """This rank's pieces of the model and optimizer state, for ``par_zero.save_pieces`` / ``load_pieces``."""
        return sharded_state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """After ``load_pieces`` filled our ``state_dict()`` (views of the buffers): step count, then params."""
        load_sharded_state_dict(self, sd)

    # ---- introspection -------------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in params, grads and optimizer state (distinct storages)."""
        out = {}
        seen: set[int] = set()
        for kind in ("params", "grads", "optim"):
            total = 0
            for b in self.buckets:
                for t in b.state_tensors()[kind]:
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

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable param, gathered in fp32 from the masters (for tests and export)."""
        return self.full_state("master")

    def full_state(self, kind: str = "master") -> dict[str, torch.Tensor]:
        """Gather ``kind`` ('master', 'exp_avg' or 'exp_avg_sq') of every trainable param, full size."""
        out = {}
        for b in self.buckets:
            flat = torch.zeros(b.N, dtype=torch.float32, device=b.device)
            flat[b.opt_lo : b.opt_hi] = getattr(b, kind)
            if self.cfg.strategy != "no_shard":
                # opt ranges are disjoint within the inner group (x outer for outer 'optim')
                comm.all_reduce(flat, b.groups.inner)
                if b.outer_optim:
                    comm.all_reduce(flat, b.groups.outer)
            for p, o in zip(b.params, b.offsets):
                out[self.param_names[p]] = flat[o : o + p.numel()].view(p.shape).clone()
        return out
