"""Muon for the hidden matrices, AdamW for the rest, over each rank's optimizer range of every bucket.

The momentum (``momentum_buffer``, torch.optim.Muon's state) is elementwise, so it lives over the
optimizer range like AdamW's moments and is saved as pieces like them; only over the Muon params'
runs of it (AdamW's moments only over the others'), packed, so a Muon param costs 4 bytes of state. Newton-Schulz needs the
whole matrix, and each whole matrix (an expert's counting as one) has ONE owner rank in the bucket's
sharding group, balanced by Newton-Schulz FLOPs (muon_owners.py). Each step, per bucket:

1. the Nesterov update ``u = lerp(g, m, mu)`` (torch's arithmetic) over this rank's range;
2. sharded strategies (ZeRO-1/2/3): one all-gather of ``u`` over the bucket's sharding group gives
   every rank of it the update of the whole bucket (what re-assembling the params does with the masters);
3. the owned matrices split over a model-parallel group (TP columns/rows, expert TP) are all-gathered
   over ``matrix_group(param)`` (one collective per bucket; the group's ranks own the same matrices)
   and put together by their placement's offsets;
4. the owner runs Newton-Schulz on each of its whole matrices (a tensor's owned experts together) and
   writes its block of the result into a zero-filled bucket-sized buffer (in the Newton-Schulz dtype);
5. a reduce-scatter (sharded) or all-reduce (no_shard) of that buffer, a sum over the sharding group,
   gives each rank its range: every element is one owner's value plus zeros, so it is that value exactly.

Exact: every step's input to Newton-Schulz is the single-device update, put together from copies
of it (no arithmetic but the elementwise momentum, which is the same on a range as on the whole),
and its output reaches the ranks unchanged. The FLOPs are split among the sharding group's ranks;
the ranks of a TP group (and HSDP's replicas) still repeat their owner's Newton-Schulz.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from par_groups import comm
from par_groups.param_placement import placement_of

from .adamw import adamw_step_
from .bucket import Bucket
from .config import DataParallelConfig
from .muon_owners import assign_buckets
from .newton_schulz import adjusted_lr, zeropower_via_newtonschulz
from .optimizer import MOMENTS, RangeStateOptimizer, contiguous_runs
from .optimizer_choice import NS_DTYPES

KINDS = MOMENTS + ("momentum_buffer",)


def _packed(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(lo, hi, at): each run of the optimizer range and where it starts in the packed state."""
    out, at = [], 0
    for lo, hi in runs:
        out.append((lo, hi, at))
        at += hi - lo
    return out


def _block_offsets(p: nn.Parameter, r: int) -> tuple[int, ...]:
    """The offsets of rank ``r``'s block of ``p`` (in its matrix group) in the last two dims."""
    pl = placement_of(p)
    block = r // (pl.copy_count() if pl.copies is not None else 1)
    last = tuple(s * block if f != s else 0 for s, f in zip(p.shape[-2:], pl.full_shape[-2:]))
    return tuple(pl.offsets[:-2]) + last


class DistributedMuon(RangeStateOptimizer):
    """Muon on the params ``is_matrix(param)`` says, AdamW (``cfg.betas``, ``cfg.eps``) on the others;
    weight decay on those ``decayed(param)`` says. ``matrix_group(param)``: the group whose ranks hold
    the other blocks of a matrix split by its placement (TP, expert TP)."""

    KINDS, NAME = KINDS, "Muon"

    def __init__(self, buckets: list[Bucket], cfg: DataParallelConfig, decayed: Callable[[nn.Parameter], bool],
                 is_matrix: Callable[[nn.Parameter], bool],
                 matrix_group: Callable[[nn.Parameter], ProcessGroup | None] = lambda p: None):
        self._init_state(buckets, cfg, decayed, is_matrix)
        self.owners = assign_buckets(buckets, self.matrices, self.args["ns_steps"])
        owned = {b: mine for o in self.owners for b, mine in o.owned.items()}
        self.owned = {b: owned[b] for b in buckets}
        # per bucket: its matrices split over a model-parallel group, that group, every rank's offsets
        self.split: dict[Bucket, tuple[dict[nn.Parameter, int], ProcessGroup | None, list]] = {}
        for b, ps in self.matrices.items():
            split = [p for p in ps if placement_of(p).full_shape[-2:] != tuple(p.shape[-2:])]
            groups = {matrix_group(p) for p in split}
            if len(groups) > 1 or None in groups:
                raise ValueError("a bucket's split matrices must share one matrix_group (not None)")
            offsets: list = []
            if split:
                group = next(iter(groups))
                every: list = [None] * dist.get_world_size(group)
                index = {p: k for k, p in enumerate(split)}  # by identity (a tensor's == is elementwise)
                mine = [(index[p], experts) for p, experts in self.owned[b] if p in index]
                # rank r's blocks: r // span along the split dim (declare_'s equal blocks, copies in runs)
                offsets = [[_block_offsets(p, r) for p in split] for r in range(len(every))]
                if not is_fake(b.master):  # on fake tensors (`plan --simulate`) an object gather has no values
                    comm.all_gather_object(every, ([placement_of(p).offsets for p in split], mine), group)
                    if any(theirs != mine for _, theirs in every):  # they gather these matrices together
                        raise ValueError(f"a TP group's ranks own different split Muon matrices "
                                         f"({[t for _, t in every]}): their buckets must hold the same params")
                    if [[o[-2:] for o in offs] for offs, _ in every] != [[o[-2:] for o in offs] for offs in offsets]:
                        raise ValueError("a split Muon matrix's blocks are not r // span along its split dim")
            self.split[b] = ({p: k for k, p in enumerate(split)}, next(iter(groups)) if groups else None, offsets)
        self.offset = {b: dict(zip(b.params, b.offsets)) for b in buckets}

    def _init_state(self, buckets, cfg: DataParallelConfig, decayed, is_matrix) -> None:
        """The state over the optimizer ranges of ``buckets`` (owned ranges, or buddy ranges: muon_buddy.py)."""
        self.buckets, self.cfg, self.lr, self.step_count = buckets, cfg, cfg.lr, 0
        self.args = cfg.declaration.args()  # a Muon declaration (declaration.py)
        self.matrices = {b: [p for p in b.params if is_matrix(p)] for b in buckets}
        for b, ps in self.matrices.items():
            for p in ps:
                if p.dim() < 2:
                    raise ValueError(f"Muon steps matrices; a param of shape {list(p.shape)} is not one")
        runs = lambda keep: {b: contiguous_runs([(lo, hi) for p, _, lo, hi, _ in b.opt_segments() if keep(p)])  # noqa: E731
                             for b in buckets}
        self.adam_runs = runs(lambda p: not is_matrix(p))
        self.adam_decay_runs = runs(lambda p: not is_matrix(p) and decayed(p))
        self.muon_runs = runs(is_matrix)
        self.decayed = decayed
        # the state, packed: AdamW's moments over the AdamW runs, the momentum over the Muon runs, back to
        # back (4 bytes per Muon param, 8 per AdamW param); range_state unpacks it over the optimizer range
        self.packed = {b: {k: _packed(self.muon_runs[b] if k == "momentum_buffer" else self.adam_runs[b]) for k in KINDS}
                       for b in buckets}
        self.state = {b: {k: torch.zeros(sum(hi - lo for lo, hi, _ in self.packed[b][k]), dtype=torch.float32,
                                         device=b.master.device) for k in KINDS} for b in buckets}
        self._unpacked: dict[tuple[Bucket, str], torch.Tensor] | None = None  # during a load: what it fills
        self.collectives_first = False  # see _step_collectives_first
        self.matrix_set = {b: set(ps) for b, ps in self.matrices.items()}

    @property
    def ns_imbalance(self) -> float:
        """max / mean Newton-Schulz FLOPs per rank of the worst sharding group (1.0: even)."""
        return max((o.imbalance for o in self.owners), default=1.0)

    # ---- the checkpoint: the state over the optimizer range ------------------------------------
    def range_state(self, bucket: Bucket, kind: str) -> torch.Tensor:
        """``kind`` over ``bucket``'s optimizer range, unpacked (zeros where the kind does not apply): a copy;
        during a load (:meth:`prepare_load` to :meth:`finish_load`) kept, filled, then packed back."""
        if kind == "master" or kind not in self.KINDS:
            return super().range_state(bucket, kind)
        full = torch.zeros_like(bucket.master, dtype=torch.float32)
        for lo, hi, at in self.packed[bucket][kind]:
            full[lo:hi] = self.state[bucket][kind][at:at + hi - lo]
        if self._unpacked is not None:
            self._unpacked[(bucket, kind)] = full
        return full

    def prepare_load(self, kinds) -> None:
        super().prepare_load(kinds)
        self._unpacked = {}

    @torch.no_grad()
    def finish_load(self, scalars: dict[str, float]) -> None:
        for (b, kind), full in (self._unpacked or {}).items():
            for lo, hi, at in self.packed[b][kind]:
                self.state[b][kind][at:at + hi - lo] = full[lo:hi]
        self._unpacked = None

    # ---- the step ----------------------------------------------------------------------------
    def _begin_step(self) -> None:
        self._unpacked = None  # a load that never finished (a model-only resume) keeps the fresh state

    def step(self, each: Callable[[Bucket], None] | None = None) -> None:
        if not self.collectives_first:
            return super().step(each)
        self._begin_step()
        self._step_collectives_first(each)

    @torch.no_grad()
    def _step_collectives_first(self, each: Callable[[Bucket], None] | None) -> None:
        """The same arithmetic, with every bucket's collectives before any state changes: a peer lost in one
        leaves this rank's masters, momentum and step count as they were before the step, so a step redone
        after regrouping starts from the same state (``[train].fault_tolerance``). Holds each bucket's new
        momentum and orthogonalized update until the end."""
        staged = {}
        for b in self.buckets:
            if self.matrices[b]:
                momentum = self.state[b]["momentum_buffer"].clone()
                staged[b] = (momentum, self._orthogonalized(b, self._grad(b), momentum))
        self.step_count += 1
        for b in self.buckets:
            self._adamw_runs(b, self._grad(b))
            if b in staged:
                self.state[b]["momentum_buffer"].copy_(staged[b][0])
                self._apply_muon(b, staged[b][1])
            if each is not None:
                each(b)

    def _grad(self, b: Bucket) -> torch.Tensor:
        return b.opt_grad if b.opt_grad.dtype == torch.float32 else b.opt_grad.float()

    @torch.no_grad()
    def _step_bucket(self, b: Bucket) -> None:
        g = self._grad(b)
        self._adamw_runs(b, g)
        if self.matrices[b]:
            self._apply_muon(b, self._orthogonalized(b, g, self.state[b]["momentum_buffer"]))

    def _adamw_runs(self, b: Bucket, g: torch.Tensor) -> None:
        c, lr, st = self.cfg, self.lr, self.state[b]
        if c.weight_decay and self.adam_decay_runs[b]:
            torch._foreach_mul_([b.master[lo:hi] for lo, hi in self.adam_decay_runs[b]], 1 - lr * c.weight_decay)
        for lo, hi, at in self.packed[b]["exp_avg"]:
            n = hi - lo
            adamw_step_(b.master[lo:hi], g[lo:hi], st["exp_avg"][at:at + n], st["exp_avg_sq"][at:at + n],
                        step=self.step_count, lr=lr, betas=c.betas, eps=c.eps, weight_decay=0.0)

    def _orthogonalized(self, b: Bucket, g: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Steps the momentum ``buf`` (packed, in place) and returns this rank's range of the orthogonalized
        update (the collectives of the step)."""
        a = self.args
        update = self._momentum_step(b, g, buf)
        whole = update  # the update of the whole bucket
        sharded = (b.opt_lo, b.opt_hi) != (0, b.N)
        if sharded:
            whole = torch.empty(b.N, dtype=update.dtype, device=update.device)
            comm.all_gather_into_tensor(whole, update, b.groups.gather_group)
        local = {p: whole[o:o + p.numel()].view(-1, *p.shape[-2:]) for p, o in zip(b.params, b.offsets)}
        split = self.split[b][0]
        full = {p: local[p][experts] for p, experts in self.owned[b] if p not in split} | self._gather_split(b, local)
        dtype = NS_DTYPES[a["ns_dtype"]]
        ortho = torch.zeros(b.N, dtype=dtype, device=update.device)  # the owners' results, zeros elsewhere
        for p, experts in self.owned[b]:
            pl, o = placement_of(p), self.offset[b][p]
            out = torch.stack([zeropower_via_newtonschulz(m, a["ns_steps"], dtype) for m in full[p]])
            rows, cols = (slice(q, q + s) for q, s in zip(pl.offsets[-2:], p.shape[-2:]))
            ortho[o:o + p.numel()].view(-1, *p.shape[-2:])[experts] = out[..., rows, cols]
        mine = ortho
        buddy = getattr(b, "buddy", None)
        if dist.get_world_size(b.groups.inner) > 1:  # x + 0 = x: the sum is each element's owner's value
            if sharded and buddy is None:
                mine = ortho.new_empty(b.S)
                comm.reduce_scatter_tensor(mine, ortho, b.groups.inner)
            else:  # a buddy range (buddy_shards) takes its range of the whole result too: muon_buddy.py
                comm.all_reduce(ortho, b.groups.inner)
                mine = ortho[b.opt_lo:b.opt_hi]
        if buddy is not None:
            buddy.ortho = ortho[buddy.opt_lo:buddy.opt_hi]
        return mine

    def _momentum_step(self, b, g: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Steps the momentum ``buf`` (packed, in place; torch's arithmetic) and returns the update over ``b``'s
        optimizer range (Nesterov's, or the momentum), zeros off the Muon runs."""
        a = self.args
        update = torch.zeros_like(b.master, dtype=torch.float32)
        for lo, hi, at in self.packed[b]["momentum_buffer"]:
            m = buf[at:at + hi - lo]
            m.lerp_(g[lo:hi], 1 - a["momentum"])
            update[lo:hi] = g[lo:hi].lerp(m, a["momentum"]) if a["nesterov"] else m
        return update

    def _apply_muon(self, b: Bucket, mine: torch.Tensor) -> None:
        for p, _, lo, hi, _ in b.opt_segments():
            if p not in self.matrix_set[b]:
                continue
            if self.cfg.weight_decay and self.decayed(p):
                b.master[lo:hi].mul_(1 - self.lr * self.cfg.weight_decay)
            b.master[lo:hi].add_(mine[lo:hi], alpha=-adjusted_lr(self.lr, self.args["adjust_lr_fn"], placement_of(p).full_shape[-2:]))

    def _gather_split(self, b: Bucket, local: dict) -> dict[nn.Parameter, torch.Tensor]:
        """This rank's owned matrices of ``b`` split over their matrix group, whole: param -> [experts, F, H]."""
        split, group, offsets = self.split[b]
        owned = [(split[p], p, experts) for p, experts in self.owned[b] if p in split]
        if not owned:  # the group's ranks own the same split matrices (checked at construction): all skip
            return {}
        mine = torch.cat([local[p][experts].reshape(-1) for _, p, experts in owned])
        every = torch.empty(len(offsets) * mine.numel(), dtype=mine.dtype, device=mine.device)
        comm.all_gather_into_tensor(every, mine, group)
        every = every.view(len(offsets), -1)
        out, at = {}, 0
        for k, p, experts in owned:
            pl, shape = placement_of(p), (len(experts), *p.shape[-2:])
            n = len(experts) * p.shape[-2] * p.shape[-1]
            full = torch.empty(len(experts), *pl.full_shape[-2:], dtype=mine.dtype, device=mine.device)
            for r, offs in enumerate(offsets):
                rows, cols = (slice(o, o + s) for o, s in zip(offs[k][-2:], p.shape[-2:]))
                full[:, rows, cols] = every[r, at:at + n].view(shape)
            out[p] = full
            at += n
        return out
