"""Muon for the hidden matrices, AdamW for the rest, over each rank's optimizer range of every bucket.

The momentum (``momentum_buffer``, torch.optim.Muon's state) is elementwise, so it lives over the
optimizer range like AdamW's moments and is saved as pieces like them. Newton-Schulz needs the
whole matrix, so each step, per bucket:

1. the Nesterov update ``u = lerp(g, m, mu)`` (torch's arithmetic) over this rank's range;
2. sharded strategies (ZeRO-1/2/3): one all-gather of ``u`` over the bucket's sharding group gives
   every rank of it the update of the whole bucket (what re-assembling the params does with the masters);
3. matrices split over a model-parallel group (TP columns/rows, expert TP) are all-gathered over
   ``matrix_group(param)`` (one collective per bucket) and put together by their placement's offsets;
   an expert tensor ``[E, F, H]`` is E matrices, each orthogonalized on its own;
4. Newton-Schulz on each whole matrix that meets this rank's range (every rank holding a piece runs it:
   the same input gives the same output, so the pieces agree with one device); the rank keeps its piece.

Exact: every step's input to Newton-Schulz is the single-device update, put together from copies
of it (no arithmetic but the elementwise momentum, which is the same on a range as on the whole).
The Newton-Schulz FLOPs are repeated on the ranks sharing a matrix (not split among them).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from par_groups import comm
from par_groups.param_placement import placement_of

from .adamw import adamw_step_
from .bucket import Bucket
from .config import DataParallelConfig
from .newton_schulz import adjusted_lr, zeropower_via_newtonschulz
from .optimizer import MOMENTS, RangeStateOptimizer, contiguous_runs
from .optimizer_choice import NS_DTYPES, muon_args

KINDS = MOMENTS + ("momentum_buffer",)
class DistributedMuon(RangeStateOptimizer):
    """Muon on the params ``is_matrix(param)`` says, AdamW (``cfg.betas``, ``cfg.eps``) on the others;
    weight decay on those ``decayed(param)`` says. ``matrix_group(param)``: the group whose ranks hold
    the other blocks of a matrix split by its placement (TP, expert TP)."""

    KINDS, NAME = KINDS, "Muon"

    def __init__(self, buckets: list[Bucket], cfg: DataParallelConfig, decayed: Callable[[nn.Parameter], bool],
                 is_matrix: Callable[[nn.Parameter], bool],
                 matrix_group: Callable[[nn.Parameter], ProcessGroup | None] = lambda p: None):
        self.buckets, self.cfg, self.lr, self.step_count = buckets, cfg, cfg.lr, 0
        self.args = muon_args(cfg.optimizer_args)
        self.state = {b: {k: torch.zeros_like(b.master, dtype=torch.float32) for k in KINDS} for b in buckets}
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
        # per bucket: its matrices split over a model-parallel group, that group, every rank's offsets
        self.split: dict[Bucket, tuple[list[nn.Parameter], ProcessGroup | None, list]] = {}
        for b, ps in self.matrices.items():
            split = [p for p in ps if placement_of(p).full_shape[-2:] != tuple(p.shape[-2:])]
            groups = {matrix_group(p) for p in split}
            if len(groups) > 1 or None in groups:
                raise ValueError("a bucket's split matrices must share one matrix_group (not None)")
            offsets: list = []
            if split:
                offsets = [None] * dist.get_world_size(next(iter(groups)))
                comm.all_gather_object(offsets, [placement_of(p).offsets for p in split], next(iter(groups)))
            self.split[b] = (split, next(iter(groups)) if groups else None, offsets)


    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        self.step_count += 1
        for b in self.buckets:
            self._step_bucket(b)

    @torch.no_grad()
    def _step_bucket(self, b: Bucket) -> None:
        c, lr, st = self.cfg, self.lr, self.state[b]
        g = b.opt_grad if b.opt_grad.dtype == torch.float32 else b.opt_grad.float()
        if c.weight_decay and self.adam_decay_runs[b]:
            torch._foreach_mul_([b.master[lo:hi] for lo, hi in self.adam_decay_runs[b]], 1 - lr * c.weight_decay)
        for lo, hi in self.adam_runs[b]:
            adamw_step_(b.master[lo:hi], g[lo:hi], st["exp_avg"][lo:hi], st["exp_avg_sq"][lo:hi], step=self.step_count,
                        lr=lr, betas=c.betas, eps=c.eps, weight_decay=0.0)
        if self.matrices[b]:
            self._muon_bucket(b, g)

    def _muon_bucket(self, b: Bucket, g: torch.Tensor) -> None:
        a, buf = self.args, self.state[b]["momentum_buffer"]
        update = torch.zeros_like(buf)
        for lo, hi in self.muon_runs[b]:
            buf[lo:hi].lerp_(g[lo:hi], 1 - a["momentum"])
            update[lo:hi] = g[lo:hi].lerp(buf[lo:hi], a["momentum"]) if a["nesterov"] else buf[lo:hi]
        whole = update  # the update of the whole bucket
        if (b.opt_lo, b.opt_hi) != (0, b.N):
            whole = torch.empty(b.N, dtype=update.dtype, device=update.device)
            comm.all_gather_into_tensor(whole, update, b.groups.gather_group)
        local = {p: whole[o:o + p.numel()].view(p.shape) for p, o in zip(b.params, b.offsets)}
        matrices = {p: local[p] for p in self.matrices[b]} | self._gather_split(b, local)
        for p, _, lo, hi, p_lo in b.opt_segments():
            if p not in matrices:
                continue
            pl = placement_of(p)
            full = matrices[p]
            out = torch.stack([zeropower_via_newtonschulz(m, a["ns_steps"], NS_DTYPES[a["ns_dtype"]])
                               for m in full.reshape(-1, *full.shape[-2:])]).view(full.shape)
            rows, cols = (slice(o, o + s) for o, s in zip(pl.offsets[-2:], p.shape[-2:]))
            mine = out[..., rows, cols].reshape(-1)[p_lo:p_lo + hi - lo]
            if self.cfg.weight_decay and self.decayed(p):
                b.master[lo:hi].mul_(1 - self.lr * self.cfg.weight_decay)
            b.master[lo:hi].add_(mine, alpha=-adjusted_lr(self.lr, a["adjust_lr_fn"], pl.full_shape[-2:]))

    def _gather_split(self, b: Bucket, local: dict) -> dict[nn.Parameter, torch.Tensor]:
        """Each matrix of ``b`` split over its matrix group, whole (its leading dims: this rank's experts)."""
        split, group, offsets = self.split[b]
        if not split:
            return {}
        mine = torch.cat([local[p].reshape(-1) for p in split])
        every = torch.empty(len(offsets) * mine.numel(), dtype=mine.dtype, device=mine.device)
        comm.all_gather_into_tensor(every, mine, group)
        every = every.view(len(offsets), -1)
        out, at = {}, 0
        for k, p in enumerate(split):
            pl = placement_of(p)
            full = torch.empty(*p.shape[:-2], *pl.full_shape[-2:], dtype=mine.dtype, device=mine.device)
            for r, offs in enumerate(offsets):
                rows, cols = (slice(o, o + s) for o, s in zip(offs[k][-2:], p.shape[-2:]))
                full[..., rows, cols] = every[r, at:at + p.numel()].view(p.shape)
            out[p] = full
            at += p.numel()
        return out
