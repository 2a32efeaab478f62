"""MoEConfig: one frozen description of an MoE layer, validated when made."""

from __future__ import annotations

import math
from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("alltoall", "allgather", "alltoall_padded")
GROUP_SCORES = ("top2", "top_k_per_group")
EXPERT_BALANCES = ("none", "replicate", "replicate+replace")


@dataclass(frozen=True)
class MoEConfig:
    """An MoE layer: router, routed SwiGLU experts, optional shared experts.

    ``ffn_hidden`` is one routed expert's intermediate size. ``n_groups``/``topk_groups`` turn on
    group-limited routing: experts form ``n_groups`` contiguous groups (align them with EP ranks
    or nodes: with ``n_groups = ep`` a group is one rank's experts) and a token picks its experts
    from its best ``topk_groups`` groups only, a group scored by ``group_score`` (the sum of its top 2
scores, "top2" as DeepSeek-V3's code, or of its top ``top_k / topk_groups``, "top_k_per_group");
with one group per node this is DeepSeek-V3's
    node-limited routing (``topk_groups`` = M nodes), which bounds the all-to-all leaving a node. ``normalize_topk`` (None: True for sigmoid, False
    for softmax) divides the chosen scores by their sum before ``routed_scaling_factor``.
    ``num_shared_experts`` shared experts are one SwiGLU of size ``num_shared_experts * ffn_hidden``
    (or ``shared_ffn_hidden``) every token goes through. ``capacity_factor`` None is dropless;
    otherwise each expert takes at most ``ceil(capacity_factor * tokens * top_k / num_experts)``
    of a rank's tokens, dropping the rest by lowest routing weight ("probs") or latest position
    ("position"). ``bias_update_rate`` > 0 enables aux-loss-free balancing (``update_bias``).
    ``expert_balance = "replicate"`` (all-to-all or all-gather dispatcher) has every EP rank compute at most
    ``ceil(pairs / ep)`` (token, expert) pairs: hot experts' excess pairs go to replicas on other
    ranks, at most ``max_replicas_per_rank`` per rank (``balance.py``, ``replicate.py``, ``replicate_gather.py``);
    given the EP ranks' NVLink domains (``MoELayer.set_domains``) replicas stay in their home domain unless
    ``replicate_across_domains``;
    ``"replicate+replace"`` (either dispatcher) also counts each expert's load so that the trainer can re-place experts
    onto EP ranks by it (``placement.py``; the layer routes by the placement it is given).
    """

    hidden: int
    ffn_hidden: int
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    normalize_topk: bool | None = None
    n_groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2"
    num_shared_experts: int = 0
    shared_ffn_hidden: int | None = None
    routed_scaling_factor: float = 1.0
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    dispatcher: str = "alltoall"
    expert_balance: str = "none"
    max_replicas_per_rank: int = 2
    replicate_across_domains: bool = False

    def __post_init__(self) -> None:
        sizes = {"hidden": self.hidden, "ffn_hidden": self.ffn_hidden, "num_experts": self.num_experts, "top_k": self.top_k,
                 "n_groups": self.n_groups, "topk_groups": self.topk_groups}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"MoEConfig sizes must be positive integers, got {bad}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}; use 1..{self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r}; use one of {SCORE_FUNCS}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy={self.drop_policy!r}; use one of {DROP_POLICIES}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher={self.dispatcher!r}; use one of {DISPATCHERS}")
        if self.expert_balance not in EXPERT_BALANCES:
            raise ValueError(f"expert_balance={self.expert_balance!r}; use one of {EXPERT_BALANCES}")
        if self.expert_balance != "none" and self.dispatcher == "alltoall_padded":
            raise ValueError(f"expert_balance={self.expert_balance!r} with dispatcher='alltoall_padded': the padded "
                             "dispatcher already computes the same padded slots on every EP rank (nothing to balance)")
        if not isinstance(self.max_replicas_per_rank, int) or self.max_replicas_per_rank < 1:
            raise ValueError(f"max_replicas_per_rank={self.max_replicas_per_rank} must be a positive integer")
        if not isinstance(self.replicate_across_domains, bool):
            raise ValueError(f"replicate_across_domains={self.replicate_across_domains!r} must be True or False")
        if self.num_experts % self.n_groups:
            raise ValueError(f"n_groups={self.n_groups} does not divide num_experts={self.num_experts}")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"topk_groups={self.topk_groups} exceeds n_groups={self.n_groups}; use 1..{self.n_groups}")
        if self.n_groups > 1 and self.top_k > self.topk_groups * (self.num_experts // self.n_groups):
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.topk_groups} groups x {self.num_experts // self.n_groups} experts "
                "a token may reach; raise topk_groups or lower top_k")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group_score={self.group_score!r}; use one of {GROUP_SCORES}")
        if self.n_groups > 1 and self.group_score == "top_k_per_group" and self.top_k % self.topk_groups:
            raise ValueError(f"topk_groups={self.topk_groups} must divide top_k={self.top_k} (groups are scored by "
                             "the sum of their top_k/topk_groups scores)")
        if self.num_shared_experts < 0 or (self.shared_ffn_hidden is not None and self.shared_ffn_hidden < 1):
            raise ValueError(f"num_shared_experts={self.num_shared_experts} must be >= 0 and shared_ffn_hidden="
                             f"{self.shared_ffn_hidden} None or >= 1")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor}; use None (dropless) or a positive number")
        coeffs = {"aux_loss_coeff": self.aux_loss_coeff, "seq_aux_loss_coeff": self.seq_aux_loss_coeff,
                  "z_loss_coeff": self.z_loss_coeff, "bias_update_rate": self.bias_update_rate}
        negative = {k: v for k, v in coeffs.items() if v < 0}
        if negative:
            raise ValueError(f"coefficients must be >= 0, got {negative}")

    @property
    def normalize(self) -> bool:
        return self.score_func == "sigmoid" if self.normalize_topk is None else self.normalize_topk

    @property
    def shared_hidden(self) -> int:
        """Intermediate size of the shared-expert SwiGLU (0: none)."""
        if self.shared_ffn_hidden is not None:
            return self.shared_ffn_hidden
        return self.num_shared_experts * self.ffn_hidden

    def capacity(self, num_tokens: int) -> int | None:
        """Per-expert capacity for ``num_tokens`` local tokens; None when dropless."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
