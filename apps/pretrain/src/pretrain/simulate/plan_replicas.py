"""`pretrain plan` (and `--simulate`): the line for [model].expert_balance = "replicate"'s replicas, bytes and
counts in words (shared by commands/plan.py and simulate/report.py, which import it, not each other)."""

from __future__ import annotations


def human_bytes(b: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def plural(n: int, noun: str, nouns: str = "") -> str:
    """1, 'layer' -> '1 layer'; 2, 'layer' -> '2 layers' (``nouns``: an irregular plural)."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def render_replicas(r: dict) -> str:
    """expert_balance = "replicate": what the replicas hold and move on one rank (sizing/replicas.py)."""
    line = (f"replicas (expert_balance=replicate): at most {r['max_replicas_per_rank']} per MoE layer, "
            f"{human_bytes(r['bytes_per_replica'])} each; held {human_bytes(r['held_per_microbatch'])} per micro-batch "
            f"in flight over {plural(r['moe_layers'], 'MoE layer')} (+ {human_bytes(r['gradient_buffer'])} of gradients in a "
            f"layer's backward); per step at most {human_bytes(r['fetch_bytes_per_step_max'])} weight fetch and "
            f"{human_bytes(r['return_bytes_per_step_max'])} gradient return received ({plural(r['microbatches'], 'micro-batch', 'micro-batches')})")
    if "replicas_per_layer" in r:
        line += (f"; as declared: {r['replicas_per_layer']} replicas per layer, max/mean slots "
                 f"{r['slots_max_over_mean_before']:.3f} -> {r['slots_max_over_mean_after']:.3f}, this rank's fetch "
                 f"{human_bytes(r['fetch_sent_per_step'])} sent, {human_bytes(r['fetch_received_per_step'])} received per step")
    return line
