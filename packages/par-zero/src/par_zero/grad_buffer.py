"""The gradient/parameter buffer: params in flat buckets, the grad-ready hooks, the collectives.

Trainable params are packed into buckets (:class:`Bucket`) in grad-ready order, dense and expert
params apart (each family reduces over its own groups); for ZeRO-3 one or more buckets per gather
unit (a layer), whose hooks gather them just in time. Each param's post-accumulate-grad hook adds
its grad into its bucket; when a bucket is complete its reduction starts (unless grad sync is off),
and all are awaited at the end of that backward. Under ``no_sync()`` grads only accumulate locally,
with no communication. Gradients are AVERAGED over the data-parallel ranks.

DDP and ZeRO-1 launch each bucket's reduction as soon as its grads are in and never wait for one
inside backward (their grad buffers persist, so there is nothing to bound), as torch DDP does;
after the step ZeRO-1 gathers several buckets' params per all-gather (param_gather.py; a transient
buffer of up to 4 buckets, which ZeRO-2, there for memory, does not take). Likewise on gloo ZeRO-1's
reduce-scatter is par_groups.comm's all-to-all (faster; a transient of the bucket's size until its
wait), ZeRO-2/3's gloo's own (``spare_memory``: ZeRO-2's peak measured 0.91-0.98x FSDP2's with
it, 0.99-1.07x with the all-to-all, three runs each of tools/bench/bench_zero.py).

Overlap (``overlap_comm``; default on, off for CPU params): with it off, ZeRO-3 prefetches a unit
only after the current one freed its params (units.py), and a ZeRO-2/3 bucket's full grad buffer
is allocated only once the reductions in flight leave room for it (``bucket_mb``), so one
reduction's buffer and the next bucket's do not sit beside the grads being computed.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
from torch import nn

from par_groups.param_placement import placement_of, sum_partial_grads_

from .bucket import Bucket
from .bucket_groups import BucketGroups
from .bucketing import apart, size_buckets
from .config import DataParallelConfig
from .param_gather import CoalescedGathers
from .units import GatherUnit, default_unit_modules


class GradBuffer:
    """The buckets of ``module``'s trainable params, their hooks and collectives (see the module doc)."""

    def __init__(self, module: nn.Module, cfg: DataParallelConfig, dense_groups: BucketGroups,
                 expert_groups: BucketGroups, units: Iterable[nn.Module] | None = None, own_bucket=(),
                 gathered_as=None):
        self.cfg = cfg
        self.dense_groups = dense_groups
        self.expert_groups = expert_groups
        self._sync = True
        self._callback_queued = False
        self._inflight: list[Bucket] = []
        self._pointed: set[nn.Parameter] = set()  # params whose .grad we set to their bucket slice
        self._unit_of: dict[Bucket, GatherUnit] = {}  # ZeRO-3: the gather unit of each bucket
        trainable = [p for p in module.parameters() if p.requires_grad]

        def family(ps):  # split params into (dense, expert) with their groups
            dense = [p for p in ps if not placement_of(p).expert]
            expert = [p for p in ps if placement_of(p).expert]
            return [(dense, self.dense_groups), (expert, self.expert_groups)]

        self.buckets: list[Bucket] = []
        self.units: list[GatherUnit] = []
        self._hooks = []
        self.gathered_as = dict(gathered_as or {})
        alone = frozenset(own_bucket) | frozenset(self.gathered_as)
        devices = {p.device.type for p in trainable}
        self.overlap = cfg.overlap_comm if cfg.overlap_comm is not None else devices != {"cpu"}
        if cfg.shard_params:
            self._build_units(module, trainable, family, units, alone)
        else:
            bucket_bytes = int(cfg.bucket_mb * 2**20)
            for ps, groups in family(trainable):
                for chunk in size_buckets(ps, bucket_bytes, alone):
                    self.buckets.append(Bucket(chunk, groups, cfg))
        self._where = {p: (b, k) for b in self.buckets for k, p in enumerate(b.params)}
        for p in self._where:
            self._hooks.append(p.register_post_accumulate_grad_hook(_weak_hook(self, GradBuffer._on_grad_ready)))
            if cfg.shard_grads:
                self._hooks.append(p.register_hook(_weak_hook(self, GradBuffer._point_grad, p)))
        weakref.finalize(self, _remove_hooks, self._hooks)

    @property
    def buddies(self) -> list:
        """The buddy ranges this rank steps beside its own (buddy.py; empty without buddy_shards)."""
        return [b.buddy for b in self.buckets if getattr(b, "buddy", None) is not None]

    def families(self) -> list[tuple[BucketGroups, list[Bucket]]]:
        """The dense buckets and the expert ones (if on their own groups), each with its groups."""
        if self.expert_groups is self.dense_groups:
            return [(self.dense_groups, self.buckets)] if self.buckets else []
        out = [(g, [b for b in self.buckets if b.groups is g]) for g in (self.dense_groups, self.expert_groups)]
        return [(g, bs) for g, bs in out if bs]

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
            bs = [Bucket(part, groups, self.cfg, self.gathered_as.get(part[0]) if len(part) == 1 else None)
                  for fam, groups in family(ps) if fam for part in apart(fam, alone)]
            self.buckets.extend(bs)
            is_root = m is module
            unit = GatherUnit(m, bs, self.cfg.reshard_after_forward and not is_root, self.overlap)
            self._hooks.extend(unit.install(is_root))
            self.units.append(unit)
        for a, b in zip(self.units, self.units[1:]):
            a.next, b.prev = b, a
        self._unit_of = {b: u for u in self.units for b in u.buckets}

    # ---- backward ---------------------------------------------------------------------------
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

    def _point_grad(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """ZeRO-2/3, before autograd accumulates ``p``'s grad: point ``p.grad`` at its slice of the
        bucket, so the grad is added there in place (no layout copy of it, no second add)."""
        bucket, k = self._where[p]
        # p.grad set by us earlier and not accumulated since (an autograd.grad capture) may view
        # a buffer since reduced: point it again
        if (p.grad is None or p in self._pointed) and grad.dtype == bucket.cfg.grad_dtype and not grad.is_sparse:
            if bucket.full_grad is None:
                self._new_full_grad(bucket)
            p.grad = bucket.grad_view(k)
            self._pointed.add(p)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._retire(block=False)  # only the done ones: free their buffers now, not at the next launch
        bucket, k = self._where[p]
        if bucket.full_grad is None:
            self._new_full_grad(bucket)
        bucket.accumulate(k, p.grad)
        p.grad = None
        self._pointed.discard(p)
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.reshard()  # ZeRO-3: free the gathered params before the reduction's buffers arrive
            if self._sync:
                self._launch(bucket)
            unit = self._unit_of.get(bucket)
            if unit is not None and all(b.pending == 0 for b in unit.buckets):
                unit.prefetch_prev()

    def _new_full_grad(self, bucket: Bucket) -> None:
        """Allocate a bucket's full grad buffer; with overlap off, first wait until the reductions
        in flight leave room for it (see :meth:`_retire`)."""
        if not self.overlap:
            self._retire(block=True, room=bucket.N)
        bucket.new_full_grad()

    def _launch(self, bucket: Bucket) -> None:
        """Start a bucket's reduction. ZeRO-2/3 first wait until the older ones in flight leave room
        for it (see :meth:`_retire`): what a reduction holds (its input, the backend's copy) stays
        bounded. DDP and ZeRO-1 reduce buffers that persist anyway, so they never wait here (as
        torch DDP: a wait inside backward stalls the grads computed after it)."""
        if self.cfg.shard_grads:
            self._retire(block=True, room=bucket.N)
        bucket.launch_reduce()
        self._inflight.append(bucket)

    def _retire(self, block: bool, room: int = 0) -> None:
        """Pop finished reductions, oldest first. With ``block``, also wait on the oldest while the
        elements in flight plus ``room`` exceed one bucket's worth (``bucket_mb``, or the biggest
        of them): one bucket's reduction overlaps the next one's grads, not several."""
        while self._inflight:
            busy = block and sum(b.N for b in self._inflight) + room > self._window(room)
            if not self._inflight[0].try_finish(block=busy):
                return
            self._inflight.pop(0)

    def _window(self, room: int) -> int:
        """Elements allowed in flight when ``room`` more join: one bucket's worth (``bucket_mb``),
        or ``room`` itself when a single bucket is bigger."""
        return max(int(self.cfg.bucket_mb * 2**20) // 4, room)

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

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.zero_grad()

    @torch.no_grad()
    def sync_params(self, step: Callable[[Callable[[Bucket], None]], None] | None = None) -> None:
        """Re-assemble the params from each rank's optimizer range (after a step or a load).

        ``step(each)``: an optimizer step calling ``each(bucket)`` once a bucket is updated, which
        starts that bucket's re-assembly at once, so it runs while the next buckets step. ZeRO-1
        gathers several buckets per collective (param_gather.py); ZeRO-2, which is about memory,
        and ZeRO-3 with outer 'optim' one per bucket, bounded like the reductions."""
        if self.cfg.shard_optimizer and not self.cfg.shard_grads:
            gathers = CoalescedGathers(self._window(0))
            self._each_stepped(step, gathers.add)
            gathers.finish()
            return
        inflight: list[tuple[object, int]] = []  # (work, elements)

        def launch(b: Bucket) -> None:
            while inflight and sum(n for _, n in inflight) + b.N > self._window(b.N):
                inflight.pop(0)[0].wait()
            w = b.launch_param_sync()
            if w is not None:
                inflight.append((w, b.N))

        self._each_stepped(step, launch)
        for w, _ in inflight:
            w.wait()

    def _each_stepped(self, step, each: Callable[[Bucket], None]) -> None:
        """``each(bucket)`` for every bucket: after its update inside ``step(each)``, or at once without a step."""
        if step is not None:
            step(each)
        else:
            for b in self.buckets:
                each(b)

    @torch.no_grad()
    def sum_partial_grads(self) -> int:
        """After the reduction: sum the grads whose placement is partial over model-parallel copies
        (sequence-parallel norms, replicated KV heads), in this rank's optimizer range. Sums are
        linear, so after the DP mean is as good as before it; copies hold identical buckets, so the
        ranges line up. Returns how many param pieces were summed."""
        items = [(b.opt_grad[lo:hi], placement_of(p)) for b in self.buckets + self.buddies
                 for p, _, lo, hi, _ in b.opt_segments() if placement_of(p).needs_grad_sum()]
        return sum_partial_grads_(items)


def _weak_hook(owner: GradBuffer, method: Callable, tensor: torch.Tensor | None = None) -> Callable:
    """A tensor hook calling ``method(owner, [tensor,] *args)`` while ``owner`` lives, holding both
    weakly. Torch keeps a tensor's hooks in C++, out of sight of Python's cycle collector, so a hook
    holding the buffer (which holds the tensor) would keep the model, the buffers and their process
    groups alive after the wrapper is dropped."""
    owner_ref = weakref.ref(owner)
    tensor_ref = None if tensor is None else weakref.ref(tensor)

    def hook(*args):
        me = owner_ref()
        if me is None:
            return None
        return method(me, *args) if tensor_ref is None else method(me, tensor_ref(), *args)
    return hook


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()
