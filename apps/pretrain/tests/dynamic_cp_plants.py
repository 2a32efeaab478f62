"""A rank entry planting a bug in dynamic CP under fault tolerance (imported by name in the rank processes)."""


def stale_plan_width(*args, **kwargs) -> dict:
    """``replica_kills.sigkill_at(*args, **kwargs)``, with the planted bug "the survivors plan the global batch over
    the lost generation's dp x cp ranks": every dynamic-CP plan after the first keeps the first one's rank set, so
    the pieces placed on the lost ranks' places are trained by no one."""
    import replica_kills

    from pretrain.training import dynamic_cp

    build, first = dynamic_cp.SpanGroups.__init__, {}

    def building(self, ranks):
        build(self, ranks)
        first.setdefault("ranks", ranks)
        if len(first["ranks"]) > len(ranks):
            self.ranks = first["ranks"]

    dynamic_cp.SpanGroups.__init__ = building
    return replica_kills.sigkill_at(*args, **kwargs)
