"""``[model].expert_balance = "replicate"``: the bytes the replicas move and hold (par_moe.balance, .replicate).

Per MoE layer and micro-batch, a home rank sends each replica of one of its experts that expert's
weights, w_gate and w_up ``[F/etp, H]`` and w_down ``[H, F/etp]`` (its expert-TP shard): 3 H F / etp
elements in the parameters' dtype, in one all-to-all; the backward returns each replica's gradient,
the same bytes. How many replicas a micro-batch makes follows the routing (the plan's
``fetched(rank)``: sent, ``replicas[rank]``: received); a rank receives at most
``max_replicas_per_rank`` per MoE layer, so that bounds its buffers.
"""

from __future__ import annotations


def expert_elements(model, etp: int) -> int:
    """Elements of one routed expert's weights on one expert-TP rank."""
    return 3 * model.hidden * model.expert_ffn_hidden // etp


def replica_bytes(model, etp: int, replicas: int, param_bytes: int) -> int:
    """Bytes of the weight fetch of ``replicas`` replicas (and of their gradients' return): one direction."""
    return replicas * expert_elements(model, etp) * param_bytes


def replica_buffer_bytes(model, etp: int, param_bytes: int) -> int:
    """The most one rank holds per MoE layer for its replicas: their weights and their gradients."""
    replicas = model.max_replicas_per_rank if model.expert_balance != "none" else 0  # replicate, replicate+replace
    return 2 * replica_bytes(model, etp, replicas, param_bytes)
