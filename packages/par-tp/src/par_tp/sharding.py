"""Cut a full weight into this rank's shard and gather the shards back (checkpoints, model import).

Shards are contiguous equal chunks along one dimension, in TP-rank order, Megatron's layout:
column-parallel weights ``[out, in]`` split dim 0, row-parallel weights split dim 1, vocab
embeddings split dim 0 (the vocabulary).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from par_groups import comm


def check_divisible(what: str, value: int, tp_size: int) -> None:
    """Raise a ValueError naming the numbers and the TP sizes that would work."""
    if value % tp_size:
        valid = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(f"tp={tp_size} does not divide {what}={value}; use one of {valid}")


def shard_tensor(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``full`` along ``dim`` (a copy, detached)."""
    check_divisible(f"size of dim {dim}", full.shape[dim], tp_size)
    return full.detach().chunk(tp_size, dim=dim)[tp_rank].clone()


def gather_tensor(shard: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """The full tensor from every rank's chunk along ``dim`` (no autograd)."""
    n = dist.get_world_size(group)
    shard = shard.detach()
    if n == 1:
        return shard.clone()
    out = torch.empty((n * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return torch.cat(out.view(n, *shard.shape).unbind(0), dim=dim)


def kv_head_layout(num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(kv heads per rank, ranks sharing each kv head): split heads if tp divides them, else replicate."""
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size, 1
    if tp_size % num_kv_heads == 0:
        return 1, tp_size // num_kv_heads
    raise ValueError(
        f"tp={tp_size} and num_kv_heads={num_kv_heads}: one must divide the other "
        f"(split KV heads when tp divides them, replicate them when they divide tp)"
    )


def shard_kv_heads(full: torch.Tensor, num_kv_heads: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's KV-head rows of a full ``[num_kv_heads * head_dim, ...]`` weight; replicated if fewer heads than ranks."""
    local, replicas = kv_head_layout(num_kv_heads, tp_size)
    heads = full.detach().chunk(num_kv_heads, dim=0)
    first = (tp_rank // replicas) * local
    return torch.cat(heads[first : first + local], dim=0).clone()


def gather_kv_heads(shard: torch.Tensor, num_kv_heads: int, group: ProcessGroup) -> torch.Tensor:
    """The full KV weight back from the shards (replicated heads taken from their first holder)."""
    n = dist.get_world_size(group)
    _, replicas = kv_head_layout(num_kv_heads, n)
    stacked = gather_tensor(shard.unsqueeze(0), 0, group)  # [n, rows, ...]
    return torch.cat(stacked[::replicas].unbind(0), dim=0)
