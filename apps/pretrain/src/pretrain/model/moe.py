"""DeepSeek-style MoE layers of the model, from par-moe, configured from ``[model]``."""

from __future__ import annotations

from par_moe import MoEConfig


def moe_config(config) -> MoEConfig:
    return MoEConfig(
        hidden=config.hidden,
        ffn_hidden=config.moe_ffn_hidden or config.ffn_hidden,
        num_experts=config.num_experts,
        top_k=config.top_k,
        score_func=config.score_func,
        n_groups=config.n_groups,
        topk_groups=config.topk_groups,
        group_score=config.group_score,
        num_shared_experts=config.shared_experts,
        routed_scaling_factor=config.routed_scaling,
        normalize_topk=config.normalize_topk,
        aux_loss_coeff=config.aux_loss_coeff,
        seq_aux_loss_coeff=getattr(config, "seq_aux_loss_coeff", 0.0),
        z_loss_coeff=config.z_loss_coeff,
        bias_update_rate=config.bias_update_rate,
        capacity_factor=config.capacity_factor or None,
        dispatcher=config.dispatcher,
        expert_balance=config.expert_balance,
        max_replicas_per_rank=config.max_replicas_per_rank,
        replicate_across_domains=config.replicate_across_domains,
    )


def moe_layers(chunks) -> list:
    """The MoE layers (``par_moe.MoELayer``) of ``chunks`` (a rank's ``{chunk id: ModelChunk}``), MTP's too."""
    return [layer.mlp for chunk in chunks.values() for layer in chunk.decoder_layers() if layer.is_moe]
