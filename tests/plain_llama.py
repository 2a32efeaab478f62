"""The plain-PyTorch model the trainer is checked against: Llama-3 (GQA) or DeepSeek-V3 (MLA, MoE,
multi-token prediction), written out here from the papers and Hugging Face's modeling code.

It shares with ``pretrain`` only what a reference may share: the initial weights
(``pretrain.model.reference.init_full_state``, loaded by Hugging Face name, so a wrong shape or a
missing tensor fails the load) and, in the tests, the batches. RoPE (both layouts; the scaled
frequencies of ``rope_scaling`` come from transformers' ``ROPE_INIT_FUNCTIONS``), attention, Qwen3's qk_norm,
MLA, the MTP streams and loss are computed here; norms, SDPA and cross entropy are torch's; the
MoE layer is par-moe's loop-over-experts ``ReferenceMoE`` (independent of its fast path, its
capacity written out from the formula), configured here from ``[model]``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100
LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm (HF DeepseekV3RMSNorm's default)


def yarn_get_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq_and_factor(dim: int, a, device) -> tuple[torch.Tensor, float]:
    """RoPE frequencies and the factor on cos/sin under ``[model].rope_scaling``, from transformers'
    ``ROPE_INIT_FUNCTIONS`` (an oracle outside the project; plain RoPE: ``theta^(-2j/dim)``)."""
    s = a.rope_scaling or {}
    if s.get("rope_type", "default") == "default":
        return 1.0 / (a.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim)), 1.0
    freq, factor = transformers_rope(dim, a.rope_theta, tuple(sorted(s.items())))
    return freq.to(device), factor


@functools.lru_cache(maxsize=8)  # once per model shape, not per layer and forward
def transformers_rope(dim: int, theta: float, scaling: tuple) -> tuple[torch.Tensor, float]:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    s = dict(scaling)
    original = s.get("original_max_position_embeddings")
    cfg = LlamaConfig(hidden_size=dim, num_attention_heads=1, head_dim=dim,
                      max_position_embeddings=int(original * s["factor"]) if original else 4096,
                      rope_parameters={"rope_theta": theta, **s})
    freq, factor = ROPE_INIT_FUNCTIONS[s["rope_type"]](cfg, "cpu")
    return freq.float(), float(factor)


def rotate(re: torch.Tensor, im: torch.Tensor, positions: torch.Tensor, a) -> torch.Tensor:
    """Rotate the complex numbers ``re + i im`` (``[S, B, heads, D/2]``) by ``position * freq``
    (complex multiplication, as DeepSeek's reference code); out: ``[real parts | imaginary parts]``."""
    freq, factor = inv_freq_and_factor(2 * re.shape[-1], a, re.device)
    turn = torch.polar(torch.full_like(freq, factor), positions.float()[:, None] * freq)[:, None, None, :]
    z = torch.complex(re.float(), im.float()) * turn
    return torch.cat([z.real, z.imag], dim=-1).to(re.dtype)


def rope_rotate_half(x, positions, a):
    """Llama: dimension j pairs with j + D/2."""
    half = x.shape[-1] // 2
    return rotate(x[..., :half], x[..., half:], positions, a)


def rope_interleaved(x, positions, a):
    """DeepSeek: dimension 2j pairs with 2j + 1 (the output comes de-interleaved, as in HF)."""
    return rotate(x[..., 0::2], x[..., 1::2], positions, a)


def attention(q, k, v, scale=None):
    """Causal attention over ``[S, B, heads, D]``, GQA by repeating KV heads; out ``[S, B, heads * Dv]``."""
    s, b = q.shape[:2]
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return o.permute(2, 0, 1, 3).reshape(s, b, -1)


class GQA(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        d = a.kv_channels or a.hidden // a.heads
        self.a, self.d = a, d
        if a.qk_norm:  # Qwen3: one RMSNorm over each query and key head, before RoPE
            self.q_norm, self.k_norm = nn.RMSNorm(d, eps=a.norm_eps), nn.RMSNorm(d, eps=a.norm_eps)
        self.q_proj = nn.Linear(a.hidden, a.heads * d, bias=False)
        self.k_proj = nn.Linear(a.hidden, a.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(a.hidden, a.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(a.heads * d, a.hidden, bias=False)

    def forward(self, x):
        s, b, _ = x.shape
        pos = torch.arange(s, device=x.device)
        q, k = self.q_proj(x).view(s, b, -1, self.d), self.k_proj(x).view(s, b, -1, self.d)
        if self.a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_rotate_half(q, pos, self.a), rope_rotate_half(k, pos, self.a)
        return self.o_proj(attention(q, k, self.v_proj(x).view(s, b, -1, self.d)))


class MLA(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (HF ``DeepseekV3Attention``'s names and math)."""

    def __init__(self, a) -> None:
        super().__init__()
        self.a, n = a, a.heads
        dqk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            self.q_a_proj = nn.Linear(a.hidden, a.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(a.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(a.q_lora_rank, n * dqk, bias=False)
        else:
            self.q_proj = nn.Linear(a.hidden, n * dqk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(a.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(a.kv_lora_rank, n * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * a.v_head_dim, a.hidden, bias=False)

    def forward(self, x):
        a, (s, b, _) = self.a, x.shape
        dn, dr, pos = a.qk_nope_head_dim, a.qk_rope_head_dim, torch.arange(s, device=x.device)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if a.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(s, b, a.heads, dn + dr).split([dn, dr], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, dr], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(s, b, a.heads, -1).split([dn, a.v_head_dim], -1)
        q = torch.cat([q_nope, rope_interleaved(q_pe, pos, a)], dim=-1)
        k = torch.cat([k_nope, rope_interleaved(k_pe.view(s, b, 1, dr), pos, a).expand(s, b, a.heads, dr)], dim=-1)
        scale = (dn + dr) ** -0.5
        rs = a.rope_scaling or {}
        if rs.get("rope_type", "default") != "default" and rs.get("mscale_all_dim"):  # DeepSeek's softmax mscale
            scale *= yarn_get_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
        return self.o_proj(attention(q, k, v, scale))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def routed_experts(a):
    """par-moe's loop-over-experts reference layer, configured from ``[model]`` here."""
    from par_moe import MoEConfig, ReferenceMoE

    normalize = a.score_func == "sigmoid" if a.norm_topk_prob is None else a.norm_topk_prob  # HF's norm_topk_prob
    return ReferenceMoE(MoEConfig(
        hidden=a.hidden, ffn_hidden=a.moe_ffn_hidden or a.ffn_hidden, num_experts=a.num_experts, top_k=a.top_k,
        score_func=a.score_func, n_groups=a.n_groups, topk_groups=a.topk_groups, group_score=a.group_score,
        num_shared_experts=a.shared_experts, routed_scaling_factor=a.routed_scaling, normalize_topk=normalize,
        aux_loss_coeff=a.aux_loss_coeff, seq_aux_loss_coeff=a.seq_aux_loss_coeff, z_loss_coeff=a.z_loss_coeff,
        bias_update_rate=a.bias_update_rate, capacity_factor=a.capacity_factor or None))


class Block(nn.Module):
    def __init__(self, a, index: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        self.self_attn = MLA(a) if a.attention == "mla" else GQA(a)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        # DeepSeek's first_k_dense_replace, Qwen3-MoE's mlp_only_layers and decoder_sparse_step; MTP blocks: MoE
        sparse = index >= a.layers or (index not in a.mlp_only_layers and (index + 1) % a.decoder_sparse_step == 0)
        moe = a.num_experts > 0 and index >= a.moe_layers_start and sparse
        self.mlp = routed_experts(a) if moe else SwiGLU(a.hidden, a.ffn_hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        out = self.mlp(self.post_attention_layernorm(x))
        out, aux = out if isinstance(out, tuple) else (out, x.new_zeros(()))
        return x + out, aux


class PlainLlama(nn.Module):
    """``forward(tokens [S, B]) -> (logits [S, B, V], summed MoE balancing loss)``; HF names.
    MTP module k is ``model.layers.{layers + k - 1}`` (a block plus enorm, hnorm, eh_proj,
    shared_head.norm), as in DeepSeek-V3's released checkpoint."""

    def __init__(self, a) -> None:
        super().__init__()
        self.args = a
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(a.vocab_size, a.hidden)
        self.model.layers = nn.ModuleList(Block(a, i) for i in range(a.layers + a.mtp_depth))
        for layer in self.model.layers[a.layers:]:
            layer.enorm, layer.hnorm = nn.RMSNorm(a.hidden, eps=a.norm_eps), nn.RMSNorm(a.hidden, eps=a.norm_eps)
            layer.eh_proj = nn.Linear(2 * a.hidden, a.hidden, bias=False)
            layer.shared_head = nn.ModuleDict({"norm": nn.RMSNorm(a.hidden, eps=a.norm_eps)})
        self.model.norm = nn.RMSNorm(a.hidden, eps=a.norm_eps)
        self.lm_head = nn.Linear(a.hidden, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(self, tokens):
        """(the last main layer's output, before the final norm; the summed balancing loss)."""
        x, aux = self.model.embed_tokens(tokens), 0.0
        for layer in self.model.layers[: self.args.layers]:
            x, layer_aux = layer(x)
            aux = aux + layer_aux
        return x, aux

    def forward(self, tokens):
        x, aux = self.hidden_states(tokens)
        return self.lm_head(self.model.norm(x)), torch.as_tensor(aux)

    def mtp_loss(self, tokens, labels):
        """DeepSeek-V3 section 2.2 for ``tokens/labels [S, B]`` (``labels[i] = t[i+1]``): depth k reads
        ``h_{k-1}`` and the embedding of ``t[i+k]`` and predicts ``t[i+k+1]``; each depth's summed
        cross entropy is divided by all S * B positions; ``mtp_loss_weight / D * sum_k L_k``."""
        a, (s, _) = self.args, tokens.shape
        h, _ = self.hidden_states(tokens)
        total = 0.0
        for k in range(1, a.mtp_depth + 1):
            layer = self.model.layers[a.layers + k - 1]
            ahead = torch.zeros_like(labels)  # t[i+k] = labels[i+k-1]; past the end: token 0 ...
            ahead[: s - k + 1] = labels[k - 1:]
            target = torch.full_like(labels, IGNORE)  # ... and no target
            target[: s - k] = labels[k:]
            h = layer.eh_proj(torch.cat([layer.enorm(self.model.embed_tokens(ahead)), layer.hnorm(h)], dim=-1))
            h, _ = layer(h)
            logits = self.lm_head(layer.shared_head["norm"](h))
            total = total + F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE,
                                            reduction="sum") / target.numel()
        return total * (a.mtp_loss_weight / a.mtp_depth)


def build_plain(a, seed: int) -> PlainLlama:
    """The plain model with the trainer's initial weights (``strict``: every tensor by its HF name)."""
    from pretrain.model.reference import init_full_state

    model = PlainLlama(a)
    model.load_state_dict(dict(init_full_state(a, seed)), strict=True)
    return model
