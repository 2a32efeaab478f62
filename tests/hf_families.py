"""Tiny random transformers models of every family `pretrain convert --from-hf` reads (built offline,
seeded: the same model on every process), and the same model trained by transformers + torch.

Each family's config exercises what makes it differ: Llama 3.1's ``llama3`` RoPE scaling; Qwen3's
per-head q/k norms, a head width that is not hidden/heads and YaRN; Qwen3-MoE's dense
``mlp_only_layers``, ``norm_topk_prob`` and the switch balancing loss (``output_router_logits``);
Mixtral's renormalized softmax top-2 with linear RoPE scaling; DeepSeek-V3's MLA, YaRN and a
group-limited router with ``num_experts_per_tok != 2 * topk_group`` (a group's score is its top-2 sum).
Qwen3's YaRN factor is 2: at 4 this random model amplifies rounding so much that transformers
itself, re-run with 4 micro-batches instead of 2, moves its step-3 grad norm by 6.7e-7 (measured),
too close to the 1e-6 the tests hold us to; at 2 that noise is <= 2.4e-7.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers

VOCAB = 256


def _config(family: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64)
    if family == "llama3.1":
        return transformers.LlamaConfig(intermediate_size=48, rope_parameters={
            "rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=48, head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 5000.0, "factor": 2.0, "original_max_position_embeddings": 8}, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, head_dim=16, num_experts=4,
                                           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                           output_router_logits=True, router_aux_loss_coef=0.05,
                                           rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **common)
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                          rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0},
                                          **common)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3,
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                             "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
    if family == "gpt_oss":  # attention sees past its 128-token window from a sequence of 129 on
        return transformers.GptOssConfig(intermediate_size=16, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 2.0,
                                                          "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                                          "beta_slow": 1.0, "truncate": False},
                                         **(common | {"max_position_embeddings": 256}))
    raise ValueError(family)


CLASSES = {"llama3.1": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
FAMILIES = list(CLASSES)


def tiny_model(family: str):
    """A random model with non-trivial norms (so a wrong norm mapping shows) and, for DeepSeek, a
    non-zero selection bias."""
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[family])(_config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif family in ("deepseek_v3", "qwen3_moe", "mixtral") and p.dim() >= 2:
                p.normal_(0.0, 0.2)  # routers far from uniform: choices without near-ties
            elif family == "gpt_oss":  # biases and sinks too; experts wide enough that the SwiGLU clamps
                p.normal_(0.0, 0.7 if name.endswith("gate_up_proj") else 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def aux_loss(model, out) -> torch.Tensor | float:
    """transformers' balancing loss term as its CausalLM adds it (only with ``output_router_logits``)."""
    c = model.config
    if not getattr(c, "output_router_logits", False):
        return 0.0
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return c.router_aux_loss_coef * load_balancing_loss_func(out.router_logits, c.num_experts, c.num_experts_per_tok)


def reference_losses(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, S, V], cross-entropy) of transformers' model on ``tokens [B, S+1]``."""
    out = model(tokens[:, :-1])
    return out.logits, F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
