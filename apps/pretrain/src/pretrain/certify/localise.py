"""Where a layout first leaves the reference: a rank's shard of each module output against the same
block of the reference's full tensor, the parallel dimension that owns the shard, and the first
tensor out of its band.

Module outputs are sequence-first ``[S, B, ...]``. A rank's output of micro-batch ``m`` is a block of
the reference's full-batch tensor: batch rows ``dp_rank x per_rank + m x micro_batch`` onwards; the
sequence as the trainer shards it (CP's zigzag chunks, then SP's contiguous split over tp); trailing
dims split over tp (heads, the FFN width, the vocabulary, whose padding is compared where both
have it). Comparing every rank's block with the reference's is comparing the gathered full tensor:
the squared differences and norms are summed over the world (replicas count each time, on both
sides). An output whose shape fits none of these (inside a dispatcher, token lists) is not compared.
Parameter gradients are gathered to full tensors (:mod:`.record`) and compared whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from par_cp import shard_sequence
from par_groups import comm
from par_groups.param_placement import placement_of

from .record import full_param_names


@dataclass(frozen=True)
class ShardContext:
    tp: int
    tp_rank: int
    cp: int
    cp_rank: int
    dp: int
    dp_rank: int
    pp: int
    ep: int
    micro_batch: int
    per_rank: int  # sequences per dp rank per step
    vocab: int
    zero_sharded: bool
    device: torch.device = torch.device("cpu")  # the trainer's: where its outputs and collectives live

    @classmethod
    def of(cls, trainer) -> "ShardContext":
        g, layout, cfg = trainer.groups, trainer.layout, trainer.cfg
        return cls(layout.tp, g.rank_in("tp"), layout.cp, trainer.cp_rank, layout.dp, g.coords()["dp"], layout.pp,
                   layout.ep, layout.micro_batch, cfg.train.global_batch // layout.dp, cfg.model.vocab_size,
                   cfg.parallel.zero not in ("no_shard",) and layout.dp * layout.cp > 1, trainer.device)


def reference_block(ref: torch.Tensor, local: torch.Tensor, ctx: ShardContext, mb: int):
    """(reference block, local block, dims that split it) or None when the shapes do not line up."""
    if ref.dim() < 3 or local.dim() != ref.dim() or local.shape[1] != ctx.micro_batch:
        return None
    start = ctx.dp_rank * ctx.per_rank + mb * ctx.micro_batch
    if start + ctx.micro_batch > ref.shape[1]:
        return None
    r, dims = ref[:, start:start + ctx.micro_batch], set()
    if ctx.dp > 1:
        dims.add("dp")
    s = local.shape[0]
    if s != r.shape[0]:
        if ctx.cp > 1 and r.shape[0] % (2 * ctx.cp) == 0:
            r = shard_sequence(r, ctx.cp_rank, ctx.cp, dim=0, layout="zigzag")
            dims.add("cp")
        if s * ctx.tp == r.shape[0] and ctx.tp > 1:
            r = r[ctx.tp_rank * s:(ctx.tp_rank + 1) * s]
            dims.add("tp")
        elif s != r.shape[0]:
            return None
    for d in range(2, ref.dim()):
        n, full = local.shape[d], r.shape[d]
        if n == full:
            continue
        vocab_like = n * ctx.tp >= ctx.vocab and full >= ctx.vocab
        if ctx.tp == 1 or not (n * ctx.tp == full or vocab_like):
            return None
        lo, hi = ctx.tp_rank * n, min((ctx.tp_rank + 1) * n, full)
        if hi <= lo:
            return ref.new_zeros(0), local.new_zeros(0), dims | {"tp"}
        r, local = r.narrow(d, lo, hi - lo), local.narrow(d, 0, hi - lo)
        dims.add("tp")
    return r, local, dims


def output_errors(recorded: dict, reference: dict, names: list[str], ctx: ShardContext):
    """Per name of ``names``: the relative error of the gathered output over the world, and the dims
    that split it on some rank ({} where no rank compared it)."""
    # sum diff^2, sum ref^2, compared, non-finite mismatch: on the trainer's device, as its collectives
    stats = torch.zeros(len(names), 4, dtype=torch.float64, device=ctx.device)
    dims_here: dict[str, set] = {}
    for i, name in enumerate(names):
        for mb, local in recorded.get(name, {}).items():
            got = reference_block(reference[name], local, ctx, mb)
            if got is None:
                continue
            r, a, dims = got
            dims_here.setdefault(name, set()).update(dims)
            r, a = r.double(), a.double()
            finite = torch.isfinite(r)
            stats[i, 3] += (a[~finite] != r[~finite]).sum()
            diff = torch.where(finite, a - r, torch.zeros_like(r))
            stats[i, 0] += diff.pow(2).sum()
            stats[i, 1] += torch.where(finite, r, torch.zeros_like(r)).pow(2).sum()
            stats[i, 2] += 1
    comm.all_reduce(stats, None)
    every = [None] * dist.get_world_size()
    comm.all_gather_object(every, dims_here, None)
    dims = {name: set() for name in names}
    for d in every:
        for name, ds in d.items():
            dims[name] |= ds
    errors = {}
    for i, name in enumerate(names):
        d2, r2, n, bad = stats[i].tolist()
        if not n:
            continue
        errors[name] = float("inf") if bad else ((d2 / r2) ** 0.5 if r2 else (0.0 if d2 == 0 else float("inf")))
    return errors, dims


def module_owners(trainer, ctx: ShardContext) -> dict[str, dict]:
    """Per module name (and per parameter full name): the chunk, the pp rank holding it, and whether it
    holds expert-parallel or TP-split parameters, agreed over the world."""
    g = trainer.groups
    pp_rank = g.rank_in("pp")
    names = full_param_names(trainer)
    mine: dict[str, dict] = {}
    for c, chunk in trainer.model.chunks.items():
        for name, module in chunk.named_modules():
            params = list(module.parameters())
            expert = any(placement_of(p).expert for p in params) and ctx.ep > 1
            tp = any(placement_of(p).full_shape != tuple(p.shape) or placement_of(p).copies is not None
                     for p in params) and ctx.tp > 1
            mine.setdefault(name or "logits", {"chunk": c, "pp_rank": pp_rank, "expert": expert, "tp": tp})
        for p in chunk.parameters():
            pl, full = placement_of(p), names.get(id(p))
            if full is None:
                continue
            mine.setdefault("param:" + full, {"chunk": c, "pp_rank": pp_rank, "expert": pl.expert and ctx.ep > 1,
                                              "tp": ctx.tp > 1 and (pl.full_shape != pl.shape or pl.copies is not None)})
    every = [None] * dist.get_world_size()
    comm.all_gather_object(every, mine, None)
    out: dict[str, dict] = {}
    for d in every:
        for k, v in d.items():
            out.setdefault(k, v)
    return out


def owning_dimension(dims: set, owner: dict | None, ctx: ShardContext, grad: bool) -> str:
    """The parallel dimension that owns a tensor's shard: ep (expert parameters), cp (a sequence
    shard), tp (a TP split or TP copies), dp (a ZeRO-sharded gradient), pp (a later pipeline stage),
    else dp (the batch split) or none."""
    owner = owner or {}
    stage = owner.get("chunk", 0)
    if owner.get("expert"):
        return "ep"
    if "cp" in dims:
        return "cp"
    if owner.get("tp") or "tp" in dims:
        return "tp"
    if grad and ctx.zero_sharded:
        return "dp"
    if ctx.pp > 1 and stage > 0:
        return f"pp stage {stage}"
    if ctx.pp > 1:
        return "pp stage 0"
    return "dp" if ctx.dp > 1 else "none"
