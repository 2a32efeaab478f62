"""The single-device model every parallel layout must reproduce: a Llama-3-style decoder.

Plain PyTorch, Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight`` ...), so
the full state dict is the canonical form shared by initialisation, checkpoints and HF import.
MoE layers (DeepSeek style) use par-moe's single-device reference layer.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from .rope import apply_rope, rope_tables


class Attention(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        d = a.head_dim
        self.heads, self.kv_heads, self.head_dim, self.theta, self.scaling = a.heads, a.kv_heads, d, a.rope_theta, a.rope_scaling
        if a.qk_norm:  # Qwen3: one RMSNorm over each head's query and key, before RoPE
            self.q_norm, self.k_norm = nn.RMSNorm(d, eps=a.norm_eps), nn.RMSNorm(d, eps=a.norm_eps)
        self.q_proj = nn.Linear(a.hidden, a.heads * d, bias=False)
        self.k_proj = nn.Linear(a.hidden, a.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(a.hidden, a.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(a.heads * d, a.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [S, B, H]
        s, b, _ = x.shape
        q = self.q_proj(x).view(s, b, self.heads, self.head_dim)
        k = self.k_proj(x).view(s, b, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(s, b, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_tables(torch.arange(s, device=x.device), self.head_dim, self.theta, x.dtype, self.scaling)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # SDPA wants [B, heads, S, D]; GQA by repeating KV heads.
        rep = self.heads // self.kv_heads
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.permute(2, 0, 1, 3).reshape(s, b, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def is_moe_layer(a, index: int) -> bool:
    return a.is_moe_layer(index)


class DecoderLayer(nn.Module):
    def __init__(self, a, index: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        if a.attention == "mla":
            from .mla import MLAttention

            self.self_attn = MLAttention(a)
        else:
            self.self_attn = Attention(a)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        if is_moe_layer(a, index):
            from .moe import reference_moe

            self.mlp = reference_moe(a)
        else:
            self.mlp = SwiGLU(a.hidden, a.ffn_hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x))
        out = self.mlp(self.post_attention_layernorm(x))
        out, aux = out if isinstance(out, tuple) else (out, x.new_zeros(()))
        return x + out, aux


class Decoder(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        from .mtp import add_mtp_parts_, mtp_layer_ids

        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.layers))
        self.layers.extend(add_mtp_parts_(DecoderLayer(a, j), a, lambda: nn.RMSNorm(a.hidden, eps=a.norm_eps))
                           for j in mtp_layer_ids(a))  # multi-token prediction: see mtp.py
        self.norm = nn.RMSNorm(a.hidden, eps=a.norm_eps)


class LlamaReference(nn.Module):
    """``forward(tokens [S, B]) -> (logits [S, B, V], aux_loss)``; HF names under ``model.``."""

    def __init__(self, a) -> None:
        super().__init__()
        self.args = a
        self.model = Decoder(a)
        self.lm_head = nn.Linear(a.hidden, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output before the final norm, summed aux loss) of the main model."""
        x = self.model.embed_tokens(tokens)
        aux = x.new_zeros(())
        for layer in self.model.layers[: self.args.layers]:
            x, layer_aux = layer(x)
            aux = aux + layer_aux
        return x, aux

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.hidden_states(tokens)
        return self.lm_head(self.model.norm(x)), aux


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


def build_reference(a, seed: int) -> LlamaReference:
    model = LlamaReference(a)
    model.load_state_dict(dict(init_full_state(a, seed)))
    return model
