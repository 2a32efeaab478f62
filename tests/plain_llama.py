"""The plain-PyTorch model the trainer is checked against: Llama-3 (GQA) or DeepSeek-V3 (MLA, MoE,
multi-token prediction), written out here from the papers and Hugging Face's modeling code.

It shares with ``pretrain`` only what a reference may share: the initial weights
(``pretrain.model.initial_state.init_full_state``, loaded by Hugging Face name, so a wrong shape or a
missing tensor fails the load) and, in the tests, the batches. RoPE (both layouts; the scaled
frequencies of ``rope_scaling`` come from transformers' ``ROPE_INIT_FUNCTIONS``), attention, Qwen3's qk_norm,
MLA, the MTP streams and loss are computed here; norms, SDPA and cross entropy are torch's; the
MoE layer is par-moe's loop-over-experts ``par_moe.testing.ReferenceMoE`` (independent of its fast
path, its capacity written out from the formula; par-moe's router, losses, capacity and bias update are
checked against megatron-core's ``moe_utils`` in ``test_matches_megatron_moe.py``), configured here
from ``[model]``.
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


def inv_freq_and_factor(dim: int, config, device) -> tuple[torch.Tensor, float]:
    """RoPE frequencies and the factor on cos/sin under ``[model].rope_scaling``, from transformers'
    ``ROPE_INIT_FUNCTIONS`` (an oracle outside the project; plain RoPE: ``theta^(-2j/dim)``)."""
    s = config.rope_scaling or {}
    if s.get("rope_type", "default") == "default":
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim)), 1.0
    freq, factor = transformers_rope(dim, config.rope_theta, tuple(sorted(s.items())))
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


def rotate(re: torch.Tensor, im: torch.Tensor, positions: torch.Tensor, config) -> torch.Tensor:
    """Rotate the complex numbers ``re + i im`` (``[S, B, heads, D/2]``) by ``position * freq``
    (complex multiplication, as DeepSeek's reference code); out: ``[real parts | imaginary parts]``."""
    freq, factor = inv_freq_and_factor(2 * re.shape[-1], config, re.device)
    turn = torch.polar(torch.full_like(freq, factor), positions.float()[:, None] * freq)[:, None, None, :]
    z = torch.complex(re.float(), im.float()) * turn
    return torch.cat([z.real, z.imag], dim=-1).to(re.dtype)


def rope_rotate_half(x, positions, config):
    """Llama: dimension j pairs with j + D/2."""
    half = x.shape[-1] // 2
    return rotate(x[..., :half], x[..., half:], positions, config)


def rope_interleaved(x, positions, config):
    """DeepSeek: dimension 2j pairs with 2j + 1 (the output comes de-interleaved, as in HF)."""
    return rotate(x[..., 0::2], x[..., 1::2], positions, config)


def attention(q, k, v, scale=None):
    """Causal attention over ``[S, B, heads, D]``, GQA by repeating KV heads; out ``[S, B, heads * Dv]``."""
    s, b = q.shape[:2]
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return o.permute(2, 0, 1, 3).reshape(s, b, -1)


class GQA(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.kv_channels or config.hidden // config.heads
        self.config, self.d = config, d
        if config.qk_norm:  # Qwen3: one RMSNorm over each query and key head, before RoPE
            self.q_norm, self.k_norm = nn.RMSNorm(d, eps=config.norm_eps), nn.RMSNorm(d, eps=config.norm_eps)
        self.q_proj = nn.Linear(config.hidden, config.heads * d, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.heads * d, config.hidden, bias=False)

    def forward(self, x):
        s, b, _ = x.shape
        pos = torch.arange(s, device=x.device)
        q, k = self.q_proj(x).view(s, b, -1, self.d), self.k_proj(x).view(s, b, -1, self.d)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_rotate_half(q, pos, self.config), rope_rotate_half(k, pos, self.config)
        return self.o_proj(attention(q, k, self.v_proj(x).view(s, b, -1, self.d)))


class MLA(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (HF ``DeepseekV3Attention``'s names and math)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config, n = config, config.heads
        dqk = config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(config.hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, n * dqk, bias=False)
        else:
            self.q_proj = nn.Linear(config.hidden, n * dqk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, n * (config.qk_nope_head_dim + config.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * config.v_head_dim, config.hidden, bias=False)

    def forward(self, x):
        config, (s, b, _) = self.config, x.shape
        dn, dr, pos = config.qk_nope_head_dim, config.qk_rope_head_dim, torch.arange(s, device=x.device)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if config.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(s, b, config.heads, dn + dr).split([dn, dr], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([config.kv_lora_rank, dr], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(s, b, config.heads, -1).split([dn, config.v_head_dim], -1)
        q = torch.cat([q_nope, rope_interleaved(q_pe, pos, config)], dim=-1)
        k = torch.cat([k_nope, rope_interleaved(k_pe.view(s, b, 1, dr), pos, config).expand(s, b, config.heads, dr)], dim=-1)
        scale = (dn + dr) ** -0.5
        rs = config.rope_scaling or {}
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


def routed_experts(config):
    """par-moe's loop-over-experts reference layer, configured from ``[model]`` here."""
    from par_moe import MoEConfig
    from par_moe.testing import ReferenceMoE

    normalize = config.score_func == "sigmoid" if config.norm_topk_prob is None else config.norm_topk_prob  # HF's norm_topk_prob
    return ReferenceMoE(MoEConfig(
        hidden=config.hidden, ffn_hidden=config.moe_ffn_hidden or config.ffn_hidden, num_experts=config.num_experts, top_k=config.top_k,
        score_func=config.score_func, n_groups=config.n_groups, topk_groups=config.topk_groups, group_score=config.group_score,
        num_shared_experts=config.shared_experts, routed_scaling_factor=config.routed_scaling, normalize_topk=normalize,
        aux_loss_coeff=config.aux_loss_coeff, seq_aux_loss_coeff=config.seq_aux_loss_coeff, z_loss_coeff=config.z_loss_coeff,
        bias_update_rate=config.bias_update_rate, capacity_factor=config.capacity_factor or None))


class Block(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.self_attn = MLA(config) if config.attention == "mla" else GQA(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        # DeepSeek's first_k_dense_replace, Qwen3-MoE's mlp_only_layers and decoder_sparse_step; MTP blocks: MoE
        sparse = index >= config.layers or (index not in config.mlp_only_layers and (index + 1) % config.decoder_sparse_step == 0)
        moe = config.num_experts > 0 and index >= config.moe_layers_start and sparse
        self.mlp = routed_experts(config) if moe else SwiGLU(config.hidden, config.ffn_hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        out = self.mlp(self.post_attention_layernorm(x))
        out, aux = out if isinstance(out, tuple) else (out, x.new_zeros(()))
        return x + out, aux


class PlainLlama(nn.Module):
    """``forward(tokens [S, B]) -> (logits [S, B, V], summed MoE balancing loss)``; HF names.
    MTP module k is ``model.layers.{layers + k - 1}`` (a block plus enorm, hnorm, eh_proj,
    shared_head.norm), as in DeepSeek-V3's released checkpoint."""

    def __init__(self, config) -> None:
        super().__init__()
        self.args = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden)
        self.model.layers = nn.ModuleList(Block(config, i) for i in range(config.layers + config.mtp_depth))
        for layer in self.model.layers[config.layers:]:
            layer.enorm, layer.hnorm = nn.RMSNorm(config.hidden, eps=config.norm_eps), nn.RMSNorm(config.hidden, eps=config.norm_eps)
            layer.eh_proj = nn.Linear(2 * config.hidden, config.hidden, bias=False)
            layer.shared_head = nn.ModuleDict({"norm": nn.RMSNorm(config.hidden, eps=config.norm_eps)})
        self.model.norm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
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
        config, (s, _) = self.args, tokens.shape
        h, _ = self.hidden_states(tokens)
        total = 0.0
        for k in range(1, config.mtp_depth + 1):
            layer = self.model.layers[config.layers + k - 1]
            ahead = torch.zeros_like(labels)  # t[i+k] = labels[i+k-1]; past the end: token 0 ...
            ahead[: s - k + 1] = labels[k - 1:]
            target = torch.full_like(labels, IGNORE)  # ... and no target
            target[: s - k] = labels[k:]
            h = layer.eh_proj(torch.cat([layer.enorm(self.model.embed_tokens(ahead)), layer.hnorm(h)], dim=-1))
            h, _ = layer(h)
            logits = self.lm_head(layer.shared_head["norm"](h))
            total = total + F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE,
                                            reduction="sum") / target.numel()
        return total * (config.mtp_loss_weight / config.mtp_depth)


def build_plain(config, seed: int) -> PlainLlama:
    """The plain model with the trainer's initial weights (``strict``: every tensor by its HF name)."""
    from pretrain.model.initial_state import init_full_state

    model = PlainLlama(config)
    model.load_state_dict(dict(init_full_state(config, seed)), strict=True)
    return model
