"""Sharded state dicts that torch.distributed.checkpoint saves and reloads under any DP layout.

Every trainable param is saved as a 1-D fp32 tensor of ``numel`` elements (its master copy), and
its AdamW moments likewise. A rank holds the part of each param that falls in its optimizer
range of the flat bucket, a contiguous slice of the flattened param; we describe it as a
ShardedTensor chunk ``[offset, offset + size)``. Every rank can compute the whole layout of
its group locally, so no collective is needed to build the metadata. Replicas (DDP, HSDP outer
'no_shard') describe the same chunks and DCP's planner writes each chunk once; loading under a
different DP size or strategy reads whatever saved chunks overlap the new ones.

Frozen params are plain (replicated) tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from .bucket import Bucket

STATE = ("master", "exp_avg", "exp_avg_sq")


def _chunks_of(bucket: Bucket, offset: int, numel: int) -> list[tuple[int, int, bool]]:
    """(param offset, size, is_mine) of every optimizer owner's part of one param."""
    width = bucket.opt_hi - bucket.opt_lo
    mine = bucket.opt_lo // width
    out = []
    for q in range(bucket.N // width):
        lo, hi = max(offset, q * width), min(offset + numel, (q + 1) * width)
        if lo < hi:
            out.append((lo - offset, hi - lo, q == mine))
    return out


def _sharded(bucket: Bucket, tensor: torch.Tensor, offset: int, numel: int) -> ShardedTensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    other = (rank + 1) % world  # placement of chunks held elsewhere; only offsets matter to DCP
    metas, local = [], []
    for p_off, size, is_mine in _chunks_of(bucket, offset, numel):
        md = ShardMetadata([p_off], [size], f"rank:{rank if is_mine else other}/{tensor.device}")
        metas.append(md)
        if is_mine:
            lo = offset + p_off - bucket.opt_lo
            local.append(Shard(tensor[lo : lo + size], md))
    props = TensorProperties(dtype=torch.float32, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(metas, torch.Size([numel]), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def sharded_state_dict(dp) -> dict:
    """{"model": {fqn: master}, "optim": {"step": t, "state": {fqn: {"exp_avg", "exp_avg_sq"}}}}."""
    model, state = {}, {}
    for b in dp.buckets:
        for p, o in zip(b.params, b.offsets):
            name = dp.param_names[p]
            model[name] = _sharded(b, b.master, o, p.numel())
            state[name] = {k: _sharded(b, getattr(b, k), o, p.numel()) for k in ("exp_avg", "exp_avg_sq")}
    for name, p in dp.module.named_parameters():
        if not p.requires_grad:
            model[name] = p.detach()
    return {"model": model, "optim": {"step": torch.tensor(dp.step_count), "state": state}}


@torch.no_grad()
def load_sharded_state_dict(dp, sd: dict) -> None:
    """Copy a (DCP-loaded) state dict into the buffers and re-assemble the params."""
    mine = sharded_state_dict(dp)

    def copy(dst, src):
        if isinstance(dst, ShardedTensor):
            for a, b in zip(dst.local_shards(), src.local_shards()):
                if a.tensor.data_ptr() != b.tensor.data_ptr():
                    a.tensor.copy_(b.tensor)
        elif dst.data_ptr() != src.data_ptr():
            dst.copy_(src)

    for name, t in mine["model"].items():
        copy(t, sd["model"][name])
    for name, moments in mine["optim"]["state"].items():
        for k, t in moments.items():
            copy(t, sd["optim"]["state"][name][k])
    dp.step_count = int(sd["optim"]["step"])
    works = [b.launch_param_sync() for b in dp.buckets]
    for w in works:
        if w is not None:
            w.wait()
