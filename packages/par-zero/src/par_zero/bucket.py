# Over 300 lines on purpose: Bucket is one state machine over its flat buffers (layout, gather, reduce, step).
"""One bucket: a contiguous flat buffer of params (and grads), its shard, and its collectives.

Layout. The bucket's params sit back to back in one flat buffer of ``N`` elements, padded so
``N`` divides by the sharding-group size ``d`` (times the replica count for outer 'optim').
Inner rank ``i`` owns elements ``[i*N/d, (i+1)*N/d)``; the optimizer of that rank updates its
*optimizer range* of the flat buffer: everything for 'no_shard', the owned shard for the
sharded strategies, a 1/outer slice of it for HSDP with outer 'optim'.

Gradients are AVERAGED over the data-parallel ranks (``d * outer``): each rank's loss is a mean
over its own samples, and the average of those equals the mean over the global batch. The flat
grad buffer is divided by the DP size before a SUM collective, so this holds for any backend.

Which buffers live where (``S = N/d``):

    strategy              params at rest        grads at rest      optimizer (fp32)
    no_shard              full N                full N             N
    optim (ZeRO-1)        full N                full N             S
    optim_grads (ZeRO-2)  full N                S *                S
    optim_grads_params    S (full N gathered    S *                S
                          per unit, freed)

    * from the first reduction of a step to ``zero_grad``, which frees it (full N transiently
      per bucket while its grads arrive, freed as soon as its reduce-scatter completes)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from par_groups import comm

from .bucket_groups import BucketGroups
from .buddy import BuddyRange
from .config import DataParallelConfig


def _common_device(params: list[torch.nn.Parameter]) -> torch.device:
    """The device every param of a bucket lives on: its flat buffers are allocated there."""
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"a bucket's params must share one device, got {sorted(map(str, devices))}")
    return devices.pop()


GATHERED_ATTR = "zero3_gathered"  # the param attribute a gather function's result is published as


def _check_gather_as(gather_as, params, zero3: bool, padded: int, numel: int, d: int):
    """A gather function serves one ZeRO-3 param whose shards are whole rows of it (no padding)."""
    if gather_as is None:
        return None
    p = params[0]
    if not zero3 or len(params) != 1 or p.dim() < 2 or padded != numel or p.shape[0] % d:
        raise ValueError(f"a param gathered by its own function must be a ZeRO-3 param of its own bucket whose "
                         f"{p.shape[0]} rows divide over the {d} sharding ranks, got shape {tuple(p.shape)}")
    setattr(p, GATHERED_ATTR, None)
    return gather_as


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor, numel: int) -> None:
    t.untyped_storage().resize_(numel * t.element_size())


class Bucket:
    """A flat param/grad buffer of a few params, sharded over ``groups`` as ``cfg``'s booleans say.

    It holds the fp32 master of its optimizer range (the optimizer's moments live in the optimizer)."""

    def __init__(self, params: list[torch.nn.Parameter], groups: BucketGroups, cfg: DataParallelConfig,
                 gather_as=None):
        self.params = params
        self.groups = groups
        self.cfg = cfg
        d, r = groups.d, groups.r
        self.dp_size = d * r
        self.zero3 = cfg.shard_params
        self.outer_optim = groups.outer is not None and cfg.outer_shard_optimizer
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.device = _common_device(params)
        align = d * (r if self.outer_optim else 1)
        self.N = -(-n // align) * align
        self.S = self.N // d
        i = dist.get_rank(groups.inner)
        self.shard_lo = i * self.S
        if not cfg.shard_optimizer:
            self.opt_lo, self.opt_hi = 0, self.N
        elif self.outer_optim:
            s2 = self.S // r
            self.opt_lo = self.shard_lo + dist.get_rank(groups.outer) * s2
            self.opt_hi = self.opt_lo + s2
        else:
            self.opt_lo, self.opt_hi = self.shard_lo, self.shard_lo + self.S

        with torch.no_grad():
            original = torch.zeros(self.N, dtype=torch.float32, device=self.device)
            for p, o in zip(params, self.offsets):
                original[o : o + p.numel()].copy_(p.detach().reshape(-1))
            self.full_param = original.to(cfg.param_dtype) if cfg.param_dtype != torch.float32 else original
            for p, o in zip(params, self.offsets):
                p.data = self.full_param[o : o + p.numel()].view(p.shape)
            self.param_shard = None
            buddies = cfg.buddy_shards and d > 1 and groups.buddy_stride % d != 0  # another replica to mirror
            buddy_master = None  # ZeRO-3: the buddy's own master, taken before the full params go (fp32: they are `original`)
            if self.zero3:
                self.param_shard = self.full_param[self.shard_lo : self.shard_lo + self.S].clone()
                if buddies:
                    buddy_master = original[self._buddy_shard() * self.S:][:self.S].clone()
                _free(self.full_param)
            self.gathered = not self.zero3
            self._gather_work = None
            self.gather_as = _check_gather_as(gather_as, params, self.zero3, self.N, n, d)

            # Grads: persistent full buffer for no_shard/optim, transient full + persistent shard otherwise.
            gdt = cfg.grad_dtype
            self.persistent_full_grad = not cfg.shard_grads
            self.full_grad = torch.zeros(self.N, dtype=gdt, device=self.device) if self.persistent_full_grad else None
            if not cfg.shard_optimizer:
                self._opt_grad = self.full_grad
            elif self.persistent_full_grad:  # ZeRO-1: the optimizer reads its range of the full buffer
                self._opt_grad = self.full_grad[self.opt_lo : self.opt_hi]
            else:  # ZeRO-2/3: the grad shard exists only from the first reduction to zero_grad
                self._opt_grad = None

            # fp32 master: a view of the param storage when params are fp32, else its own copy.
            if cfg.param_dtype == torch.float32:
                self.master = self._param_view_of_opt_range()
                self.master_is_param = True
            else:
                self.master = original[self.opt_lo : self.opt_hi].clone()
                self.master_is_param = False
            self.buddy = self._buddy(original, buddy_master) if buddies else None
        del original
        self.pending = len(params)
        self.reduced = False  # opt_grad holds reduced grads not yet stepped
        self._reduce_work = None
        self._reduce_out = None
        self._reduce_inputs: list[torch.Tensor] = []  # on CUDA: inputs of the reduction in flight (_release_input)
        self._outer_pending = False

    @property
    def opt_grad(self) -> torch.Tensor:
        """The averaged grads of the optimizer range (zeros if no synced backward ran this step)."""
        if self._opt_grad is None:
            self._opt_grad = torch.zeros(self.opt_hi - self.opt_lo, dtype=self.cfg.grad_dtype, device=self.device)
        return self._opt_grad

    def _buddy_shard(self) -> int:
        return (self.shard_lo // self.S + self.groups.buddy_stride) % self.groups.d

    def _buddy(self, original: torch.Tensor, zero3_master: torch.Tensor | None) -> BuddyRange:
        """The buddy shard: the next rank's range, its master from the same values as that rank's. ZeRO-1/2 with
        fp32 params step it in place in the full params (the gather after the step brings the owner's equal
        update); ZeRO-3 holds no full params at rest, so its buddy master is a copy of its own
        (``zero3_master``), which in fp32 is the next rank's param shard too."""
        k = self._buddy_shard()
        lo, hi = k * self.S, (k + 1) * self.S
        if zero3_master is not None:
            return BuddyRange(self, k, zero3_master)
        return BuddyRange(self, k, self.full_param[lo:hi] if self.master_is_param else original[lo:hi].clone())

    def _param_view_of_opt_range(self) -> torch.Tensor:
        if self.zero3:
            return self.param_shard[self.opt_lo - self.shard_lo : self.opt_hi - self.shard_lo]
        return self.full_param[self.opt_lo : self.opt_hi]

    # ---- ZeRO-3 gather / release ---------------------------------------------------------
    def unshard(self) -> None:
        """Launch the all-gather of the full params (no-op if gathered or in flight); a bucket gathered
        by its own function (``gather_as``) runs it now and publishes what it returns instead."""
        if self.gathered or self._gather_work is not None:
            return
        if self.gather_as is not None:
            p = self.params[0]
            shard = self.param_shard.view(p.shape[0] // self.groups.d, *p.shape[1:])  # whole rows of it
            setattr(p, GATHERED_ATTR, self.gather_as(shard, self.groups.gather_group))
            self.gathered = True
            return
        _alloc(self.full_param, self.N)
        self._gather_work = comm.all_gather_into_tensor(self.full_param, self.param_shard, self.groups.gather_group, async_op=True)

    def wait_unshard(self) -> None:
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
            self.gathered = True

    def reshard(self) -> None:
        if self._gather_work is not None:  # a prefetch its unit did not use: left in flight it would
            self.wait_unshard()  # bring pre-step values to the next forward; finish it, then free
        if self.zero3 and self.gathered:
            if self.gather_as is not None:
                setattr(self.params[0], GATHERED_ATTR, None)
            else:
                _free(self.full_param)
            self.gathered = False

    # ---- gradients -----------------------------------------------------------------------
    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add one param's fresh grad into the flat buffer (called from its post-accumulate hook)."""
        if self.full_grad is None:
            self.new_full_grad()
        elif self.reduced and self.cfg.shard_optimizer and self.persistent_full_grad and self.buddy is None:  # ZeRO-1
            # A second synced backward in the same step: the buffer's other shards hold stale
            # local grads and our shard holds an average; restore "sum of contributions".
            keep = self.opt_grad * self.dp_size
            self.full_grad.zero_()
            self.opt_grad.copy_(keep)
            self.reduced = False
        if grad.data_ptr() == self.grad_view(index).data_ptr():
            return  # autograd accumulated into the bucket already (GradBuffer._point_grad)
        o = self.offsets[index]
        self.full_grad[o : o + grad.numel()].add_(grad.reshape(-1))

    def grad_view(self, index: int) -> torch.Tensor:
        """Param ``index``'s slice of the full grad buffer, in its shape."""
        p, o = self.params[index], self.offsets[index]
        return self.full_grad[o : o + p.numel()].view(p.shape)

    def new_full_grad(self) -> None:
        """A zeroed full grad buffer on the params' device (ZeRO-2/3 make one per step)."""
        self.full_grad = torch.zeros(self.N, dtype=self.cfg.grad_dtype, device=self.device)

    def launch_reduce(self) -> None:
        """Start the asynchronous reduction of the full grad buffer over the inner group."""
        if self._reduce_work is not None or self.full_grad is None:
            return
        self.full_grad.div_(self.dp_size)
        if not self.cfg.shard_optimizer or self.buddy is not None:  # buddies read the whole reduced buffer
            self._reduce_out = self.full_grad
            self._reduce_work = comm.all_reduce(self.full_grad, self.groups.inner, async_op=True)
        else:
            self._reduce_out = self.full_grad.new_empty(self.S)
            # ZeRO-1's full buffer persists: spend a transient on gloo's faster reduce-scatter (par_groups.comm)
            self._reduce_work = comm.reduce_scatter_tensor(self._reduce_out, self.full_grad, self.groups.inner, async_op=True,
                                                           spare_memory=self.cfg.shard_grads)
            if self.cfg.shard_grads:  # ZeRO-2/3 keep only the shard: drop the full buffer now (see _release_input)
                self._release_input(self.full_grad)
                self.full_grad = None
        self._outer_pending = self.groups.outer is not None

    def _release_input(self, t: torch.Tensor) -> None:
        """Drop the bucket's reference to ``t``, the input of the reduction just launched.

        CUDA rule: a collective reads its input on the communicator's stream after the call returns,
        and the caching allocator hands a block freed on the compute stream to the next kernel at once,
        so the input must stay referenced until ``wait()`` (which orders the compute stream after the
        communicator's) and is freed there. On the CPU (gloo) the work holds what it still reads itself,
        so the buffer goes now, while backward runs (the measured ZeRO-2/3 peak)."""
        if t.device.type != "cpu":
            self._reduce_inputs.append(t)

    def try_finish(self, block: bool) -> bool:
        """Advance this bucket's reduction (inner, then outer, then in place); True once done.

        Finishing early frees ZeRO-2/3's full grad buffer while backward still runs."""
        if self._reduce_out is None:
            return True
        if self._reduce_work is not None:
            if not block and not self._reduce_work.is_completed():
                return False
            self._reduce_work.wait()
            self._reduce_work = None
            self._reduce_inputs.clear()  # after the wait: freeing them is ordered after the collective
            if self._outer_pending:
                self._outer_pending = False
                self._launch_outer()
                return self.try_finish(block)
        self._finish()
        return True

    def _launch_outer(self) -> None:
        out = self._reduce_out
        if self.outer_optim:
            self._reduce_out = out.new_empty(self.S // self.groups.r)
            self._reduce_work = comm.reduce_scatter_tensor(self._reduce_out, out, self.groups.outer, async_op=True,
                                                           spare_memory=True)
            self._release_input(out)  # the inner shard: the outer reduction's input
        else:
            self._reduce_work = comm.all_reduce(out, self.groups.outer, async_op=True)

    def _finish(self) -> None:
        """Put the averaged grads where the optimizer reads them."""
        out, self._reduce_out = self._reduce_out, None
        if self.cfg.shard_grads and self.buddy is not None:  # ZeRO-2/3 with a buddy: our shard and its, of the whole
            b = self.buddy
            if self._opt_grad is None:  # the step's first reduction: copies, as the full buffer goes now
                self._opt_grad, b.grad = out[self.opt_lo:self.opt_hi].clone(), out[b.opt_lo:b.opt_hi].clone()
            else:
                self._opt_grad.add_(out[self.opt_lo:self.opt_hi])
                b.opt_grad.add_(out[b.opt_lo:b.opt_hi])
            self.full_grad = None
        elif self.cfg.shard_grads:
            if self._opt_grad is None:  # the first reduction of the step: its output is the shard
                self._opt_grad = out
            else:
                self._opt_grad.add_(out)
            self.full_grad = None  # ZeRO-2/3 keep only the shard
        elif self.cfg.shard_optimizer and out is not self.full_grad:  # ZeRO-1 (no_shard, buddies: in place)
            self.opt_grad.copy_(out)
        self.reduced = True

    def zero_grad(self) -> None:
        if self.persistent_full_grad:
            self.full_grad.zero_()
        else:  # ZeRO-2/3 free the grad shard between steps, as torch's zero_grad(set_to_none)
            self.full_grad = None
            self._opt_grad = None
            if self.buddy is not None:
                self.buddy.grad = None
        self.reduced = False
        self.pending = len(self.params)

    # ---- parameters ----------------------------------------------------------------------
    @torch.no_grad()
    def write_master(self) -> None:
        """After the step: copy the master into the params' dtype (no-op when the master is the params)."""
        if not self.master_is_param:
            self._param_view_of_opt_range().copy_(self.master)

    def own_params(self) -> torch.Tensor:
        """ZeRO-1: this rank's shard of the full params, the part it stepped (a view)."""
        return self.full_param[self.shard_lo : self.shard_lo + self.S]

    @torch.no_grad()
    def launch_param_sync(self):
        """After the step: copy the master into the param dtype and start re-assembling params."""
        self.write_master()
        if not self.cfg.shard_optimizer:
            return None
        if self.zero3:
            if not self.outer_optim:
                return None  # the shard is the truth; the next forward gathers it
            mine = self.param_shard[self.opt_lo - self.shard_lo : self.opt_hi - self.shard_lo].clone()
            return comm.all_gather_into_tensor(self.param_shard, mine, self.groups.outer, async_op=True)
        return comm.all_gather_into_tensor(self.full_param, self.own_params().clone(), self.groups.gather_group,
                                           async_op=True)

    # ---- introspection -------------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The persistent tensors holding params, grads and the fp32 master (for measuring bytes;
        the master counts as optimizer state, and only when it is not the params themselves)."""
        params = [self.param_shard] if self.zero3 else [self.full_param]
        grads = [self.full_grad] if self.persistent_full_grad else [self.opt_grad]
        if self.buddy is not None and not self.persistent_full_grad:  # ZeRO-2: the buddy's gradient shard
            grads.append(self.buddy.opt_grad)
        optim = [] if self.master_is_param else [self.master]
        if self.buddy is not None and not self.master_is_param:
            optim.append(self.buddy.master)
        elif self.buddy is not None and self.zero3:  # fp32 ZeRO-3: the buddy's master is the next rank's param shard
            params.append(self.buddy.master)
        return {"params": params, "grads": grads, "optim": optim}

    def opt_segments(self):
        """(param, index, lo, hi, p_lo): the part [lo, hi) of the optimizer range holding
        elements [p_lo, p_lo + hi - lo) of the flattened param."""
        for k, (p, o) in enumerate(zip(self.params, self.offsets)):
            lo, hi = max(o, self.opt_lo), min(o + p.numel(), self.opt_hi)
            if lo < hi:
                yield p, k, lo - self.opt_lo, hi - self.opt_lo, lo - o
