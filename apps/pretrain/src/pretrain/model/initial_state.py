"""The model's initial weights as a full (unsharded) state dict, drawn once for every layout.

Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight`` ..., shapes from
``shapes.py``), so the full state dict is the canonical form shared by initialisation,
checkpoints and HF import. The initial weights are the one thing the plain-PyTorch reference of
the tests (tests/plain_llama.py) shares with the trainer.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .shapes import full_shapes


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

    def __init__(self, config, seed: int) -> None:
        self.config, self.seed, self.shapes = config, seed, full_shapes(config)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        return self.piece(name, (0,) * len(self.shapes[name]), self.shapes[name])

    def piece(self, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The block ``[offsets, offsets + shape)`` of tensor ``name``, drawing only the tiles it overlaps."""
        if self.config.tie_embeddings and name == "lm_head.weight":
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
            block = torch.randn(size, generator=gen) * self.config.init_std
            start = [max(o, l) for o, l in zip(offsets, lo)]  # the overlap of tile and piece, in full coordinates
            stop = [min(o + n, l + z) for o, n, l, z in zip(offsets, shape, lo, size)]
            out[tuple(slice(x - o, y - o) for x, y, o in zip(start, stop, offsets))] = \
                block[tuple(slice(x - l, y - l) for x, y, l in zip(start, stop, lo))]
        return out

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def init_full_state(config, seed: int) -> InitialState:
    """See :class:`InitialState` (a lazy mapping of full tensors)."""
    return InitialState(config, seed)
