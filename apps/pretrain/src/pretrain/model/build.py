"""Build what one rank trains: its pipeline chunks, cut from the full model, under a DP wrapper."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from par_groups import ParallelGroups, declare_copies_, placement_of
from par_pp import build_schedule, chunks_on_rank
from par_tp import VocabParallelEmbedding
from par_zero import DataParallel, TorchFSDP2, data_parallel

from ..blocks.context import ChunkContext
from ..blocks.dropout import DropoutPosition
from ..config.fault_rules import buddy_strides
from .compile import compile_blocks_
from .expert_grads import scale_expert_grads_
from .fp8 import use_fp8_linears_
from .fp8_gather import fp8_gathered_weights
from .materialize import materialize_, on_meta
from .muon_split import uses_muon
from .offload import Offloader
from .parallel import ModelChunk
from .shapes import hf_name
from .initial_state import init_full_state


@dataclass
class RankModel:
    """This rank's chunks (``chunks[c]`` for global chunk id c), the DP wrapper, and the schedule."""

    groups: ParallelGroups
    chunks: dict[int, ModelChunk]
    module: nn.Module  # what the DP wrapper wraps: the single chunk, or a ModuleDict of chunks
    dp: DataParallel | TorchFSDP2
    schedule: object | None  # a par_pp Schedule when pp > 1
    num_chunks: int
    dropout: DropoutPosition = field(default_factory=DropoutPosition)  # its chunks' (set before each micro-batch)

    def parameters(self):
        return self.module.parameters()

    def full_named_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer of this rank's chunks, by its full-model (HF) name;
        each one's placement says which block of that full tensor it is."""
        return {hf_name(n, chunk.config.tie_embeddings): t
                for chunk in self.chunks.values() for n, t in chunk.state_dict(keep_vars=True).items()}


def _hsdp_groups(groups: ParallelGroups, replicas: int, timeout: timedelta, moe: bool) -> tuple:
    """Split every dp x cp group into ``replicas`` replicas of consecutive inner sharding groups; the experts'
    groups alike (``moe``: :func:`_expert_hsdp_lists`). Returns (inner, outer, expert inner, expert outer): the
    expert-dp group and None where the experts shard over their whole expert-dp group."""
    inner_lists, outer_lists = [], []
    for g in groups.physical(groups.grid.ranks("dp-cp")):
        h = len(g) // replicas
        inner_lists += [g[i * h:(i + 1) * h] for i in range(replicas)]
        outer_lists += [g[i::h] for i in range(h)]
    made = [dist.new_subgroups_by_enumeration(lists, timeout=timeout)[0] for lists in (inner_lists, outer_lists)]
    experts = _expert_hsdp_lists(groups, inner_lists) if moe else None
    if experts is None:
        return (*made, groups.edp, None)
    return (*made, *(dist.new_subgroups_by_enumeration(lists, timeout=timeout)[0] for lists in experts))


def _expert_hsdp_lists(groups: ParallelGroups, inner_lists: list[list[int]]) -> tuple | None:
    """The experts' HSDP rank lists, (inner, outer): each expert-dp group split by HSDP replica (the dense
    sharding group its ranks lie in), sharded inside one and replicated over the replicas, as the dense params
    are, so that each replica holds a whole copy of the experts. None where a replica does not hold an equal part
    of every expert-dp group (an expert-parallel group spanning replicas): the experts then shard over their
    whole expert-dp group."""
    replica_of = {r: i for i, g in enumerate(inner_lists) for r in g}
    inner, outer = [], []
    for g in groups.physical(groups.grid.expert_ranks("dp")):
        parts: dict[int, list[int]] = {}
        for r in g:
            parts.setdefault(replica_of[r], []).append(r)
        sizes = {len(part) for part in parts.values()}
        if len(parts) < 2 or len(sizes) != 1:
            return None
        inner += list(parts.values())
        outer += [list(ranks) for ranks in zip(*parts.values())]
    return inner, outer


def chunk_layout(cfg, layout, pp_rank: int):
    """(schedule or None, this rank's chunk ids, layer ranges of all chunks)."""
    p = cfg.parallel
    if layout.pp == 1:
        return None, [0], [range(cfg.model.layers)]
    schedule = build_schedule(p.schedule, layout.pp, layout.microbatches, vpp=layout.vpp)
    ranges = p.chunk_layers(cfg.model.layers)
    assert len(ranges) == len(schedule.chunk_ranks)
    return schedule, list(chunks_on_rank(schedule, pp_rank)), ranges


def build_rank_model(cfg, layout, groups: ParallelGroups, full_state: dict[str, torch.Tensor] | None = None,
                     device: torch.device = torch.device("cpu"), declared_routing=None) -> RankModel:
    """This rank's model in ``groups`` (made from the layout's grid under the run's rank permutation).
    ``declared_routing``: a run on fake tensors (``train_loop.ShapesOnly``): MoE layers route as it
    declares."""
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    context = ChunkContext(groups, layout.sequence_parallel, cfg.parallel.cp_comm_type, cfg.train.seq_len, cfg.model.recompute,
                    cfg.model.attention_backend, cfg.model.backend, cfg.parallel.tp_comm_overlap,
                    declared_routing=declared_routing, qk_clip=cfg.train.muon_qk_clip > 0,
                    offload=cfg.model.offload, offloader=Offloader() if cfg.model.offload else None)
    schedule, mine, ranges = chunk_layout(cfg, layout, groups.rank_in("pp"))
    num_chunks = len(ranges)
    state = full_state if full_state is not None else init_full_state(cfg.model, cfg.train.seed)
    with on_meta():  # shapes and placements only; each rank then fills just its pieces
        chunks = {c: ModelChunk(cfg.model, ranges[c], c == 0, c == num_chunks - 1, context) for c in mine}
    copies = _share_embedding_(chunks, num_chunks, groups, cfg.model) if cfg.model.mtp_depth else []
    materialize_(list(chunks.values()), device)
    for chunk in chunks.values():
        chunk.load_full_state_(state)  # the last stage's embedding copy loads model.embed_tokens too
    if cfg.model.tie_embeddings:
        copies += _tie_embeddings(chunks, num_chunks, groups, shared=bool(copies))
    if cfg.model.backend == "te":  # TE computes the local matmuls; the weights stay ours
        from ..blocks.te import use_te_linears_

        for chunk in chunks.values():
            use_te_linears_(chunk)
    if cfg.train.par_fp8:  # par's FP8 GEMMs in the local matmuls; the weights stay as they are
        for chunk in chunks.values():
            use_fp8_linears_(chunk, cfg.train.fp8, groups)
    for chunk in chunks.values():
        for layer in chunk.decoder_layers():
            layer.aux_scale = 1.0 / layout.microbatches  # aux loss scaled like the main loss
    if cfg.train.compile:
        compile_blocks_([layer for chunk in chunks.values() for layer in chunk.decoder_layers()], groups.tp)
    module = chunks[mine[0]] if len(mine) == 1 else nn.ModuleDict({str(c): chunks[c] for c in mine})
    scale_expert_grads_(module, layout)
    t = cfg.train
    # Megatron's mixed precision: bf16 params for compute; fp32 main weights and Adam moments in the
    # (sharded) optimizer; grads accumulated and reduced in [train].grad_reduce_dtype
    bf16 = t.resolved_dtype(device.type) == "bf16"
    kwargs = dict(expert_dp_group=groups.edp, lr=t.lr, weight_decay=t.weight_decay,
                  units=list(dict.fromkeys(u for c in mine for u in chunks[c].gather_units())),  # MTP's embedding: once
                  no_decay=functools.partial(no_decay, tied=cfg.model.tie_embeddings),
                  own_bucket=[p for m in copies for p in m.parameters()],
                  param_dtype=torch.bfloat16 if bf16 else torch.float32,
                  reduce_dtype=torch.bfloat16 if bf16 and t.grad_reduce_dtype == "bf16" else torch.float32)
    zero = cfg.parallel.zero
    if zero == "torch_fsdp2":  # the layouts it runs with: config/checks.py data_parallel_rules; the same mixed precision
        kwargs = dict(lr=t.lr, weight_decay=t.weight_decay, no_decay=no_decay,
                      param_dtype=kwargs["param_dtype"], reduce_dtype=kwargs["reduce_dtype"])
    optimizer = t.optimizer_declaration  # [train].optimizer, declared (par_zero.declaration)
    if optimizer.gathers == "matrix":  # Muon's split: model/muon_split.py; a matrix split by TP is gathered over tp / etp
        optimizer = replace(optimizer, matrices=functools.partial(muon_param, tied=cfg.model.tie_embeddings),
                            matrix_group=lambda p: groups.etp if placement_of(p).expert else groups.tp)
    kwargs["optimizer"] = optimizer
    inner, outer, expert_inner, expert_outer = _hsdp_groups(groups, cfg.parallel.hsdp_replicas, timeout, cfg.model.is_moe) \
        if cfg.parallel.hsdp_replicas > 1 else (groups.dp_cp, None, groups.edp, None)
    if t.fp8_param_gather:  # ZeRO-3 gathers the FP8 linears' weights in FP8 (model/fp8_gather.py)
        kwargs["gathered_as"] = fp8_gathered_weights(chunks.values(), t.fp8, dist.get_world_size(inner))
    if t.buddy_shards:  # config/fault_rules.py: par's ZeRO-1, 2 or 3 over the whole dp only
        # each shard's copy on the next replica (config/fault_rules.py: the strides, and the refusal of an order or
        # placement under which a copy lies in its own replica)
        dense, expert = buddy_strides(cfg.parallel)
        kwargs.update(buddy_shards=t.buddy_shards, buddy_stride=dense, expert_buddy_stride=expert)
    if expert_outer is not None:  # experts replicated over the HSDP replicas as the dense params
        kwargs.update(expert_dp_group=expert_inner, expert_outer_group=expert_outer)
    if outer is not None:
        dp = data_parallel(module, inner, zero, outer_group=outer, **kwargs)
    else:
        dp = data_parallel(module, inner, zero, **kwargs)
    return RankModel(groups, chunks, module, dp, schedule, num_chunks, context.dropout)


def muon_param(name: str, param: nn.Parameter, tied: bool = False) -> bool:
    """Whether the DP wrapper's param ``name`` (a chunk's, or ``<chunk id>.`` and a chunk's) steps with Muon."""
    local = name.split(".", 1)[1] if name.split(".", 1)[0].isdigit() else name
    return uses_muon(hf_name(local, tied), placement_of(param).full_shape)


def no_decay(name: str, param: nn.Parameter, tied: bool = False) -> bool:
    """No weight decay on norms and biases (1-D) nor on the input embedding, as nanoGPT and Megatron;
    ``tied``: the output head is the embedding (on a last stage it is a copy named ``lm_head``)."""
    return param.dim() < 2 or "embed_tokens" in name or "shared_embedding" in name or (tied and "lm_head" in name)


def _share_embedding_(chunks: dict[int, ModelChunk], num_chunks: int, groups: ParallelGroups, model_cfg) -> list[nn.Module]:
    """Give the last chunk's MTP modules the input embedding; returns the embedding copies made.

    On the rank of chunk 0 (pp=1, V schedules) it is that very module. Otherwise, as Megatron's
    shared embedding: the last stage holds a copy of chunk 0's vocabulary shard (filled from
    ``model.embed_tokens``, so equal at start), and both are declared copies over the embedding
    group with partial grads: ``DataParallel.sum_partial_grads`` adds the input use's and MTP's
    grads once per step, so both copies take the same update; the norm and checkpoints count
    the first copy. Each copy sits in a bucket of its own so both stages shard it alike.
    """
    first, last = 0, num_chunks - 1
    if first in chunks and last in chunks:  # pp=1 (chunk 0 is the last) or a V schedule's rank 0
        if first != last:
            chunks[last].shared_embedding = chunks[first].embed_tokens
        return []
    if last in chunks:
        with on_meta():
            module = VocabParallelEmbedding(model_cfg.padded_vocab(groups.size("tp")), model_cfg.hidden, groups.tp,
                                            sequence_parallel=chunks[last].sp)
            chunks[last].shared_embedding = module
    elif first in chunks:
        module = chunks[first].embed_tokens
    else:  # a middle stage
        return []
    return [declare_copies_(module, groups.embedding, partial_grad=True)]


def _tie_embeddings(chunks: dict[int, ModelChunk], num_chunks: int, groups: ParallelGroups,
                    shared: bool) -> list[nn.Module]:
    """The output projection is the input embedding, as in the single-device model; returns the
    embedding copies made (for their own buckets).

    Both are split by vocabulary rows over TP, so the shards coincide. On the rank holding both
    ends (pp=1, a V schedule's rank 0) they are one Parameter. Otherwise, as Megatron ties them
    over pipeline stages: the last stage's head weight is a copy of the first stage's embedding
    (both loaded from ``model.embed_tokens``), declared copies over the embedding group with
    partial grads, so ``sum_partial_grads`` adds the input's and the head's grads and both copies
    take the same update. ``shared``: MTP already made that copy (``_share_embedding_``); the
    head then uses it too.
    """
    first, last = 0, num_chunks - 1
    if first in chunks and last in chunks:
        chunks[last].lm_head.weight = chunks[first].embed_tokens.weight
        return []
    if shared:
        if last in chunks:
            chunks[last].lm_head.weight = chunks[last].shared_embedding.weight
        return []
    if last in chunks:
        return [declare_copies_(chunks[last].lm_head, groups.embedding, partial_grad=True)]
    if first in chunks:
        return [declare_copies_(chunks[first].embed_tokens, groups.embedding, partial_grad=True)]
    return []
