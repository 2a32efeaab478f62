"""DeepSeek-style MoE layers of the model, from par-moe, configured from ``[model]``."""

from __future__ import annotations

from par_moe import MoEConfig


def moe_config(a) -> MoEConfig:
    return MoEConfig(
        hidden=a.hidden,
        ffn_hidden=a.moe_ffn_hidden or a.ffn_hidden,
        num_experts=a.num_experts,
        top_k=a.top_k,
        score_func=a.score_func,
        n_groups=a.n_groups,
        topk_groups=a.topk_groups,
        group_score=a.group_score,
        num_shared_experts=a.shared_experts,
        routed_scaling_factor=a.routed_scaling,
        normalize_topk=a.normalize_topk,
        aux_loss_coeff=a.aux_loss_coeff,
        seq_aux_loss_coeff=getattr(a, "seq_aux_loss_coeff", 0.0),
        z_loss_coeff=a.z_loss_coeff,
        bias_update_rate=a.bias_update_rate,
        capacity_factor=a.capacity_factor or None,
        dispatcher=a.dispatcher,
    )
