"""The model as one rank holds it: its pipeline chunks, built from par-tp, par-cp and par-moe.

Every chunk is cut out of the full single-device state dict (``reference.init_full_state`` or a
checkpoint), each tensor taking the block its placement declares (``par_groups.placement_of``), so
any tp x cp x pp x dp (x ep x etp) layout holds the same model.

Shapes inside a chunk: tokens ``[S/cp, B]`` in, activations ``[S/cp/tp, B, H]`` between layers
with sequence parallelism (``[S/cp, B, H]`` without), vocab-sharded logits ``[S/cp, B, V/tp]`` out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from par_groups import declare_copies_, placement_of
from par_tp import (
    ColumnParallelLinear,
    TPSwiGLU,
    VocabParallelEmbedding,
    gather_from_sequence_parallel,
    scatter_to_sequence_parallel,
    vocab_parallel_cross_entropy,
)

from ..blocks.context import ChunkContext
from ..blocks.dropout import hidden_dropout
from ..blocks.recompute import checkpointed
from ..blocks.te import fuse_norm_
from ..data.packing import Documents
from ..models import family_of
from .aux_loss import attach_aux_loss
from .mtp import add_mtp_parts_, mtp_gather_units, mtp_loss
from .shapes import hf_name, mtp_layer_ids
from .moe import moe_config


def _norm(config, context: ChunkContext, inside_tp: bool = False) -> nn.RMSNorm:
    """A copy on every TP rank. Its grad is partial over TP with sequence parallelism (each rank sees
    its shard), or when it runs inside the TP region, on the input of this rank's matmuls only
    (``inside_tp``: the TE backend fuses it into the next matmul, te.TENormProjections)."""
    norm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
    return declare_copies_(norm, context.groups.tp, context.sequence_parallel or inside_tp)


class ParallelDecoderLayer(nn.Module):
    def __init__(self, config, index: int, context: ChunkContext, position: int | None = None) -> None:
        super().__init__()
        g, sp = context.groups, context.sequence_parallel
        # [model].offload (offload.py): these modules' saved activations wait in host memory
        self.offloader = context.offloader
        self.offloaded = context.offloads(index, position) if context.offloader is not None else frozenset()
        self.backend = context.backend
        self.is_moe = config.is_moe_layer(index)
        # [model].recompute for this layer (recompute_policy.py): the whole layer, or some of its modules
        self.full_recompute = context.recomputes("full", index)
        self.recompute_norms = context.recomputes("layernorm", index)
        self.recompute_mlp = context.recomputes("moe" if self.is_moe else "mlp", index)
        self.index, self.hidden_dropout, self.dropout_at = index, config.hidden_dropout, context.dropout
        # what a recomputation must replay: MoE routing, dropout masks' place (else torch's checkpoint alone)
        self.replays = self.is_moe or config.hidden_dropout > 0 or config.attention_dropout > 0
        # TE backend: each norm fused with the matmul after it (GQA attention's wq, a dense MLP's gate)
        family = family_of(config)
        self.attention_norm_inside = context.backend == "te" and "te_norm_fusion" in family.supports
        self.mlp_norm_inside = context.backend == "te" and not self.is_moe
        self.input_layernorm = _norm(config, context, self.attention_norm_inside)
        self.self_attn = family.build_attention(config, context, index)
        self.post_attention_layernorm = _norm(config, context, self.mlp_norm_inside)
        # Without SP the tp ranks hold the same tokens: a MoE layer takes this rank's 1/tp of the
        # sequence (as under SP) and gathers its output back, so each token reaches its experts once.
        # (Routing every tp rank's copy sent each token to every expert of the EP group tp times:
        # their gradients and the aux-free load were tp x the single rank's.)
        self.moe_splits_tokens = self.is_moe and not sp and g.size("tp") > 1
        self.moe_tp_group = g.tp
        if self.is_moe:
            # Balancing losses over the global micro-batch (every dp x cp x tp rank's tokens), as on
            # one device; the sequence-wise one over the ranks splitting a sequence.
            # Router and shared experts: copies over TP, seeing this rank's sequence shard.
            split = sp or self.moe_splits_tokens
            aux_group, sequence_group = (g.tp_dp_cp, g.tp_cp) if split else (g.dp_cp, g.cp)
            self.mlp = family.build_moe(moe_config(config), g.ep, g.etp, aux_group=aux_group, sequence_group=sequence_group,
                                copies=g.tp, partial_grad=split, routing=context.declared_routing)
        else:
            self.mlp = TPSwiGLU(config.hidden, config.ffn_hidden, g.tp, sp, comm_overlap=context.tp_comm_overlap)
        # The MoE aux loss is this rank's share of the micro-batch's loss; DP averages grads over
        # dp x cp ranks, so scale by dp x cp to give the loss's gradient (aux_scale: 1/micro-batches).
        self.aux_scale = 1.0
        self.dp_cp_size = g.size("dp_cp")
        if self.is_moe and context.recomputes("moe_act", index):
            self.mlp.experts.recompute_act = True
        if self.attention_norm_inside:
            fuse_norm_(self.self_attn, self.input_layernorm)
        if self.mlp_norm_inside:
            fuse_norm_(self.mlp, self.post_attention_layernorm)

    def _part(self, module: nn.Module, recomputed: bool, x: torch.Tensor, offload: str = ""):
        """``module(x)``, rerun in the backward where ``recomputed`` (not inside a recomputed layer), its
        saved activations in host memory where ``offload`` names an offloaded module."""
        if offload in self.offloaded and torch.is_grad_enabled():
            return self._offloaded(lambda y: self._part(module, recomputed, y), module, x)
        if recomputed and not self.full_recompute and torch.is_grad_enabled():
            return checkpointed(module, x, backend=self.backend, dropout=self.dropout_at, replay=self.replays)
        return module(x)

    def _offloaded(self, fn, module: nn.Module, x: torch.Tensor, *args):
        with self.offloader.region(module, x.device) as moved:
            out = fn(x, *args)
        first = out[0] if isinstance(out, tuple) else out
        self.offloader.prefetch_on_grad(first, moved)
        return out

    def _forward(self, x: torch.Tensor, docs: Documents | None = None, where=None) -> torch.Tensor:
        packed = {} if docs is None else {"docs": docs}  # the attention core's packed documents
        normed = x if self.attention_norm_inside else self._part(self.input_layernorm, self.recompute_norms, x, "layernorm")
        if "attn" in self.offloaded and torch.is_grad_enabled():
            attn = self._offloaded(lambda y: self.self_attn(y, **packed), self.self_attn, normed)
        else:
            attn = self.self_attn(normed, **packed)
        x = x + (attn if where is None else hidden_dropout(attn, self.hidden_dropout, where, self.index, 0))
        h = x if self.mlp_norm_inside else self._part(self.post_attention_layernorm, self.recompute_norms, x, "layernorm")
        if self.moe_splits_tokens:  # backward: the sequence's gradient all-gathered (replicated again)
            h = scatter_to_sequence_parallel(h, self.moe_tp_group)
        out = self._part(self.mlp, self.recompute_mlp, h, "moe" if self.is_moe else "mlp")
        if self.is_moe:
            out, aux = out
            out = attach_aux_loss(out, aux, self.aux_scale * self.dp_cp_size)
        if self.moe_splits_tokens:  # the consumers are replicated: backward keeps this rank's rows
            out = gather_from_sequence_parallel(out, self.moe_tp_group, output_grad_is_partial=False)
        return x + (out if where is None else hidden_dropout(out, self.hidden_dropout, where, self.index, 1))

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        # [model].hidden_dropout: the micro-batch's place, taken now so that a recomputation draws the same mask
        where = self.dropout_at.at if self.hidden_dropout > 0 and self.training else None
        if "layer" in self.offloaded and torch.is_grad_enabled():
            return self._offloaded(self._whole, self, x, docs, where)
        return self._whole(x, docs, where)

    def _whole(self, x: torch.Tensor, docs: Documents | None, where) -> torch.Tensor:
        if self.full_recompute and torch.is_grad_enabled():
            return checkpointed(self._forward, x, docs, where, backend=self.backend, dropout=self.dropout_at,
                                replay=self.replays)
        return self._forward(x, docs, where)


def _mtp_layer(config, j: int, context: ChunkContext) -> ParallelDecoderLayer:
    layer = add_mtp_parts_(ParallelDecoderLayer(config, j, context), config, lambda: _norm(config, context))
    declare_copies_(layer.eh_proj, context.groups.tp, context.sequence_parallel)  # like the norms
    return layer


class ModelChunk(nn.Module):
    """A contiguous run of layers; the first chunk embeds, the last one norms and projects to logits."""

    def __init__(self, config, layer_ids: range, first: bool, last: bool, context: ChunkContext) -> None:
        super().__init__()
        g, sp = context.groups, context.sequence_parallel
        self.tp_group, self.sp = g.tp, sp
        self.first, self.last, self.config = first, last, config
        self.layer_ids = list(layer_ids)
        rows = config.padded_vocab(g.size("tp"))  # Megatron's vocabulary padding; the head masks the pad
        # with SP its partial lookups are reduce-scattered to the sequence shard (not all-reduced, then split)
        self.embed_tokens = VocabParallelEmbedding(rows, config.hidden, g.tp, sequence_parallel=sp) if first else None
        self.layers = nn.ModuleDict({str(i): ParallelDecoderLayer(config, i, context, n) for n, i in enumerate(layer_ids)})
        self.norm = _norm(config, context) if last else None
        self.lm_head = (ColumnParallelLinear(config.hidden, rows, g.tp, sequence_parallel=sp, comm_overlap=context.tp_comm_overlap)
                        if last else None)
        # Multi-token prediction modules sit with the output head and share the input embedding:
        # this chunk's, chunk 0's on the same rank (V schedules), or a copy of it kept equal over the
        # embedding group (other schedules); the builder sets it (build.py's _share_embedding_).
        self.mtp = nn.ModuleDict({str(j): _mtp_layer(config, j, context) for j in mtp_layer_ids(config)} if last else {})
        self.shared_embedding = None

    def forward(self, x: torch.Tensor, docs: Documents | None = None):
        """Hidden states to the next chunk; the last chunk returns logits, or (logits, hidden) with MTP.
        ``docs``: the micro-batch's packed documents (``[data].document_mask`` / ``reset_position_ids``)."""
        if self.first:
            x = self.embed_tokens(x)  # [S/cp, B] -> [S/cp/tp, B, H] with SP
        for layer in self.layers.values():
            x = layer(x, docs)
        if self.last:
            logits = self.project(self.norm(x))
            return (logits, x) if len(self.mtp) else logits
        return x

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits; padded rows (past vocab_size) are -inf, so the
        softmax, the loss and their gradients are the unpadded model's."""
        logits = self.lm_head(x)
        start = placement_of(self.lm_head.weight).offsets[0]
        real = min(max(self.config.vocab_size - start, 0), logits.shape[-1])
        if real == logits.shape[-1]:
            return logits
        return F.pad(logits[..., :real], (0, logits.shape[-1] - real), value=float("-inf"))

    def mtp_loss(self, hidden: torch.Tensor, streams: list[torch.Tensor]) -> torch.Tensor:
        """This rank's weighted MTP loss (see mtp.py) from the main model's last hidden states."""
        def cross_entropy(logits, targets):
            return vocab_parallel_cross_entropy(logits.float(), targets, self.tp_group, reduction="sum")

        return mtp_loss(self.config, hidden, streams, list(self.mtp.values()),
                        self.embed_tokens if self.first else self.shared_embedding,
                        lambda layer, x: layer(x),
                        self.project, cross_entropy)

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.layers.values()) + list(self.mtp.values())

    def gather_units(self) -> list[nn.Module]:
        """The modules ZeRO-3 gathers one at a time, in forward order."""
        units = [self.embed_tokens] if self.first else []
        units += list(self.layers.values())
        shared = [self.shared_embedding] if self.shared_embedding is not None else []
        mtp = [u for layer in self.mtp.values() for u in mtp_gather_units(layer)]
        return units + ([self.norm, self.lm_head] + shared + mtp if self.last else [])

    @torch.no_grad()
    def load_full_state_(self, state) -> "ModelChunk":
        """Copy into every parameter and buffer its block of the full (HF-named) tensor, as its placement
        says. A state that can draw pieces (``initial_state.InitialState.piece``) draws only that block."""
        for name, t in self.state_dict(keep_vars=True).items():
            pl = placement_of(t)
            if hasattr(state, "piece"):
                t.copy_(state.piece(hf_name(name, self.config.tie_embeddings), pl.offsets, pl.shape))
            else:
                t.copy_(block_of(state[hf_name(name, self.config.tie_embeddings)], pl.offsets, pl.shape))
        return self


def block_of(full: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The block ``[offsets, offsets + shape)`` of ``full``; rows past its end (vocabulary padding) are zeros."""
    inside = tuple(max(0, min(n, f - o)) for o, n, f in zip(offsets, shape, full.shape))
    block = full[tuple(slice(o, o + n) for o, n in zip(offsets, inside))]
    if inside == tuple(shape):
        return block
    out = block.new_zeros(shape)
    out[tuple(slice(0, n) for n in inside)] = block
    return out
