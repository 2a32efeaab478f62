"""The model's full (unsharded) state dict: every tensor's shape and its initial values.

Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight`` ...), so the full state
dict is the canonical form shared by initialisation, checkpoints and HF import. The initial
weights are the one thing the plain-PyTorch reference of the tests (tests/plain_llama.py) shares
with the trainer: they are drawn here once, independently of any layout.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensor


def is_moe_layer(a, index: int) -> bool:
    return a.is_moe_layer(index)


def layer_shapes(a, i: int) -> dict[str, tuple[int, ...]]:
    """Shapes of decoder layer ``i``'s tensors (HF names under ``model.layers.{i}.``)."""
    d, h, p = a.head_dim, a.hidden, f"model.layers.{i}."
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    if a.attention == "mla":
        from .mla import mla_shapes

        shapes |= mla_shapes(a, p + "self_attn.")
    else:
        shapes |= {p + "self_attn.q_proj.weight": (a.heads * d, h), p + "self_attn.k_proj.weight": (a.kv_heads * d, h),
                   p + "self_attn.v_proj.weight": (a.kv_heads * d, h), p + "self_attn.o_proj.weight": (h, a.heads * d)}
        if a.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    if is_moe_layer(a, i):
        e, f = a.num_experts, a.moe_ffn_hidden or a.ffn_hidden
        shapes |= {p + "mlp.router.weight": (e, h), p + "mlp.router.expert_bias": (e,),
                   p + "mlp.experts.w_gate": (e, f, h), p + "mlp.experts.w_up": (e, f, h),
                   p + "mlp.experts.w_down": (e, h, f)}
        if a.shared_experts:
            fs = a.shared_experts * f
            shapes |= {p + "mlp.shared.w_gate": (fs, h), p + "mlp.shared.w_up": (fs, h), p + "mlp.shared.w_down": (h, fs)}
    else:
        f = a.ffn_hidden
        shapes |= {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
    return shapes


def full_shapes(a) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of the full state dict (HF names), without building the model."""
    from .mtp import mtp_shapes

    h = a.hidden
    shapes = {"model.embed_tokens.weight": (a.vocab_size, h), "model.norm.weight": (h,), "lm_head.weight": (a.vocab_size, h)}
    for i in range(a.layers):
        shapes |= layer_shapes(a, i)
    return shapes | mtp_shapes(a)


TILE = 1024  # rows and columns of one independently drawn block of a weight (1-D: TILE * TILE elements)


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The block each generator draws: TILE x TILE over the last two dims, one index of the others
    (an expert's slice of ``[experts, ffn, hidden]``), so a tile is at most TILE**2 elements."""
    if len(shape) == 1:
        return (min(shape[0], TILE * TILE),)
    return (1,) * (len(shape) - 2) + tuple(min(n, TILE) for n in shape[-2:])


class InitialState(Mapping[str, torch.Tensor]):
    """The model's initial weights as a full (unsharded), HF-named state dict, identical for every layout.

    Each tensor is cut into tiles (:func:`tile_shape`), each drawn from its own generator seeded by
    ``(seed, name, tile)``. A value therefore depends neither on how the model is split nor on what
    else a rank asks for, and :meth:`piece` draws only the tiles a shard overlaps: a rank never
    materializes more than its own shard plus one tile (the full tensor is the piece at offset 0).
    """

    def __init__(self, a, seed: int) -> None:
        self.a, self.seed, self.shapes = a, seed, full_shapes(a)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self.piece(name, (0,) * len(self.shapes[name]), self.shapes[name])

    def piece(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block ``[offsets, offsets + shape)`` of tensor ``name``, drawing only the tiles it overlaps."""
        if self.a.tie_embeddings and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        if name.endswith("expert_bias"):
            return torch.zeros(shape)
        full, tile = self.shapes[name], tile_shape(self.shapes[name])
        inside = tuple(max(0, min(n, f - o)) for o, n, f in zip(offsets, shape, full))
        if inside != tuple(shape):  # rows past the tensor's end (vocabulary padding): zeros
            out = torch.zeros(shape)
            if all(inside):
                out[tuple(slice(0, n) for n in inside)] = self.piece(name, offsets, inside)
            return out
        out = torch.empty(shape)
        if isinstance(out, FakeTensor):  # `plan --simulate`: shapes only, no values to draw
            return out
        spans = [range(o // t, (o + n - 1) // t + 1) for o, n, t in zip(offsets, shape, tile)]
        for index in itertools.product(*spans):
            lo = [i * t for i, t in zip(index, tile)]
            size = [min(t, f - l) for t, f, l in zip(tile, full, lo)]
            key = name if not any(index) else f"{name}@{','.join(map(str, index))}"  # one-tile tensors: as before tiling
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
            block = torch.randn(size, generator=gen) * self.a.init_std
            a = [max(o, l) for o, l in zip(offsets, lo)]  # the overlap of tile and piece, in full coordinates
            b = [min(o + n, l + z) for o, n, l, z in zip(offsets, shape, lo, size)]
            out[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, offsets))] = \
                block[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))]
        return out

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def init_full_state(a, seed: int) -> InitialState:
    """See :class:`InitialState` (a lazy mapping of full tensors)."""
    return InitialState(a, seed)
