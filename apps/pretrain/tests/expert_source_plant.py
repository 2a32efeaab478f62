"""A planted bug for the expert-parallel fault tests, in the rank processes only (imported there by name): a
joiner's state comes from the live rank at another expert-parallel coordinate, whose experts it does not own."""


def wrong_expert_source(*args, **kwargs) -> dict:
    """``replica_kills.sigkill_at(*args, **kwargs)`` with each joiner's source picked at the other ep coordinate."""
    import replica_kills

    from pretrain.training import fault_replica

    def other_experts(a: dict, b: dict, shard: int = 1) -> bool:
        return a["ep"] != b["ep"] and all(a[k] == b[k] for k in ("tp", "cp", "pp"))

    fault_replica._same_block = other_experts
    return replica_kills.sigkill_at(*args, **kwargs)
