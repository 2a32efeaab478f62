"""Every config key with its default and meaning, read from the sections' dataclasses (their comments).

``pretrain keys`` prints it; the README's "Every config key" list is this output (tests/test_config_keys.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import re

FIELD = re.compile(r"^    (\w+): [^=]+?(?:= .*?)?(?:\s+#\s*(.*))?$")


# The meaning of each key its section's source leaves without a comment (a name that says it, or a
# comment above a group of keys that names the first only)
MEANINGS = {
    "model": {
        "vocab_size": "tokens in the vocabulary (the tokenizer's; 257 = bytes and EOS)",
        "hidden": "the model width (Megatron's --hidden-size)",
        "layers": "transformer blocks (--num-layers)",
        "heads": "attention (query) heads (--num-attention-heads)",
        "kv_heads": "key/value heads, grouped-query attention (--num-query-groups)",
        "ffn_hidden": "the SwiGLU MLP's inner width (--ffn-hidden-size)",
        "rope_theta": "RoPE's base (--rotary-base)",
        "norm_eps": "RMSNorm's epsilon",
        "tie_embeddings": "the output head shares the embedding's weights",
        "init_std": "the normal initialisation's standard deviation (--init-method-std)",
        "recompute": "activation recomputation: none | selective (the attention core) | full (every block), or a list "
                     "of modules (core_attn, mlp, moe_act, layernorm, mla_up_proj, moe, full), each optionally "
                     "for layers first-last: [\"core_attn\", \"mlp@0-15\"]",
        "offload": "modules whose saved activations wait in host memory for their backward (pinned, copied on a side "
                   "stream): attn, mlp, moe, layernorm, layer, each optionally for layers first-last, or layers:N "
                   "(the first N layers of each chunk)",
        "moe_layers_start": "the first layers stay dense MLPs (DeepSeek's first_k_dense_replace)",
        "num_experts": "routed experts per MoE layer; 0 = a dense model",
        "mlp_only_layers": "layer indices that stay dense (Qwen3-MoE)",
        "top_k": "experts each token is routed to",
        "shared_experts": "experts every token goes through beside the routed ones",
        "score_func": "the router's scores: softmax | sigmoid",
        "n_groups": "expert groups for group-limited routing (DeepSeek's n_group)",
        "topk_groups": "groups a token's experts may come from",
        "routed_scaling": "the routed experts' output is scaled by this (DeepSeek's routed_scaling_factor)",
        "aux_loss_coeff": "the load-balancing auxiliary loss' weight; 0 = off",
        "z_loss_coeff": "the router z-loss' weight; 0 = off",
        "bias_update_rate": "aux-loss-free balancing: each expert's bias moves by this per step; 0 = off",
        "dispatcher": "how tokens reach their experts: alltoall | allgather | alltoall_padded",
        "max_replicas_per_rank": "expert_balance = replicate: replicas one EP rank computes at most",
        "kv_lora_rank": "MLA: the compressed key/value latent's width",
        "qk_nope_head_dim": "MLA: the query/key width per head without RoPE",
        "qk_rope_head_dim": "MLA: the query/key width per head with RoPE",
        "v_head_dim": "MLA: the value width per head",
        "mtp_loss_weight": "the multi-token-prediction loss' weight",
        "linear_key_heads": "qwen3_next: Gated DeltaNet's query/key heads (linear_num_key_heads)",
        "linear_value_heads": "qwen3_next: Gated DeltaNet's value heads, a multiple of linear_key_heads",
        "linear_key_dim": "qwen3_next: Gated DeltaNet's query/key width per head",
        "linear_value_dim": "qwen3_next: Gated DeltaNet's value width per head",
        "conv_kernel": "qwen3_next: the short causal conv's taps before the delta rule",
    },
    "parallel": {
        "tp": "tensor-parallel ranks (Megatron's --tensor-model-parallel-size)",
        "pp": "pipeline stages (--pipeline-model-parallel-size)",
        "vpp": "virtual pipeline chunks per rank (interleaved schedules)",
        "cp": "context-parallel ranks: the sequence split over them (--context-parallel-size)",
        "cp_comm_type": "CP's attention exchange: p2p (ring) | a2a | allgather | a2a+p2p (hierarchical, with hcp)",
        "hcp": "a2a+p2p: [inner a2a ranks, outer ring ranks], their product = cp",
        "ep": "expert-parallel ranks (--expert-model-parallel-size)",
        "zero": "data-parallel sharding: no_shard (DDP) | optim (ZeRO-1, Megatron's distributed optimizer) | "
                "optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3) | torch_fsdp2",
        "hsdp_replicas": "ZeRO-3 sharded within groups of dp / hsdp_replicas ranks, replicated over the groups",
        "schedule": "the pipeline schedule: gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipev",
        "order": "the rank grid's dimension order, fastest first",
        "last_stage_layers": "layers on the last pipeline rank (0 = even split)",
        "max_seq_per_rank": "dynamic CP: the most tokens one rank holds (0 = seq_len / cp)",
    },
    "train": {
        "steps": "optimizer steps of the run (Megatron's --train-iters, torchtitan's training.steps)",
        "seq_len": "tokens per sequence (--seq-length)",
        "lr": "the peak learning rate",
        "min_lr": "the learning rate the decay ends at",
        "lr_wsd_decay_ratio": "wsd: the decay phase as this fraction of lr_decay_steps (torchtitan's decay_ratio)",
        "lr_wsd_decay_style": "wsd: the decay's shape: linear | cosine | exponential | minus_sqrt",
        "lr_warmup_samples": "the warm-up in samples (Megatron's --lr-warmup-samples); replaces warmup_steps",
        "lr_decay_samples": "the decay's end in samples (--lr-decay-samples); replaces lr_decay_steps",
        "lr_wsd_decay_samples": "wsd: the decay phase in samples; replaces lr_wsd_decay_steps",
        "weight_decay": "AdamW's decoupled weight decay (not on norms, biases, embeddings)",
        "beta1": "Adam's beta1 (--adam-beta1)",
        "beta2": "Adam's beta2 (--adam-beta2)",
        "optimizer_args": "the optimizer's options: sgd's momentum, dampening, nesterov (e.g. {momentum = 0.9}), lion's "
                          "betas, a torch.optim class's keywords",
        "muon_nesterov": "muon: Nesterov momentum",
        "muon_ns_steps": "muon: Newton-Schulz iterations",
        "muon_ns_dtype": "muon: Newton-Schulz in bf16 | fp32",
        "eval_batches": "global batches of held-out data per evaluation (--eval-iters)",
        "nproc": "ranks `pretrain train` starts on this host (--nproc overrides)",
        "nan_policy": "a non-finite loss or gradient norm: stop (one error line) | skip (the update is dropped)",
    },
    "data": {
        "eval_blend": "the held-out set as a blend, [[weight, prefix], ...]",
        "valid_fraction": "each source's trailing share held out for evaluation",
        "reset_position_ids": "RoPE positions restart at each document (--reset-position-ids)",
        "eod_mask_loss": "no loss on the token after an EOS (--eod-mask-loss)",
    },
    "checkpoint": {
        "keep": "checkpoints kept; older ones are deleted",
        "resume": "start from the newest checkpoint in dir",
        "async_save": "write checkpoints in the background while training goes on",
    },
    "log": {
        "every": "steps between log lines (--log-interval)",
        "progress": "the console's progress bar",
        "tensorboard": "TensorBoard scalars in <log.dir>/tensorboard",
        "wandb_project": "the W&B project",
        "wandb_tags": "the W&B run's tags",
    },
}


def field_comments(cls) -> dict[str, str]:
    """``{key: meaning}``: the comment lines just above a field and the one after it on its line."""
    out, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if line.startswith("    #") and not line.startswith("     "):
            above.append(stripped.lstrip("#").strip())
            continue
        match = FIELD.match(line) if not line.startswith("     ") else None
        if match and match[1] in {f.name for f in dataclasses.fields(cls)}:
            out[match[1]] = " ".join(above + ([match[2].strip()] if match[2] else []))
        if not stripped.startswith("#"):
            above = []
    return out


def default_of(f: dataclasses.Field) -> str:
    from .run_config import _toml_literal

    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return "unset" if value is None else _toml_literal(value)


def key_list() -> str:
    """Markdown: a bullet per key, section by section, with its TOML default and meaning."""
    from .run_config import SECTIONS

    lines = []
    for section, cls in SECTIONS.items():
        comments = field_comments(cls) | MEANINGS.get(section, {})
        lines.append(f"- `[{section}]`")
        for f in dataclasses.fields(cls):
            meaning = comments.get(f.name, "")
            lines.append(f"  - `{f.name} = {default_of(f)}`" + (f": {meaning}" if meaning else ""))
    return "\n".join(lines)
