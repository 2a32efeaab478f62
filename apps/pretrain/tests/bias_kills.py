"""Rank entry of the aux-loss-free balancing fault tests: ``replica_kills.sigkill_at``, recording the routed pairs
per expert each rank's bias update applied after every step it completes, with a planted bug if asked. Imported by
name in the rank processes (as ``replica_kills``)."""

import json
import os
from pathlib import Path

PLANTS = ("", "joiner_without_the_bias", "discarded_counts_kept")


def skipping(steps: tuple, *run_args) -> dict:
    """``run_rank(*run_args)`` whose updates of the (1-based) ``steps`` are skipped (:func:`_skip_at`)."""
    from pretrain.training.run import run_rank

    _skip_at(steps)
    return run_rank(*run_args)


def _skip_at(steps: tuple) -> None:
    """The (1-based) ``steps`` have a non-finite gradient norm where the skip is decided: their updates are dropped
    under nan_policy=skip (the logged norm is the real one)."""
    import math

    import torch

    from pretrain.training.step_result import NonFinite

    note = NonFinite.note

    def noting(self, s, loss, norm):
        return note(self, s, loss, torch.full_like(norm, math.inf) if s + 1 in steps else norm)

    NonFinite.note = noting


def balanced(plant: str, rank: int, step: int, phase: str, pid_dir: str, *run_args, skip: tuple = (), **kwargs) -> dict:
    """``sigkill_at(rank, step, phase, pid_dir, *run_args, **kwargs)``; after each step it completes, every rank
    writes the summed loads its MoE layers' bias updates applied in it to ``pid_dir/bias_<rank>_<step>.json``
    (the launcher's numbering; a redone step's overwrites the discarded one's, were it written). ``plant``:
    ``"joiner_without_the_bias"``: a joiner keeps its fresh expert bias, not the one it received;
    ``"discarded_counts_kept"``: a regrouped trainer keeps the routed pairs the discarded step counted.
    ``skip``: those steps' updates are skipped (:func:`skipping`)."""
    import replica_kills
    from par_moe.layer import MoELayer

    from pretrain.model.moe import moe_layers
    from pretrain.training import fault_replica, replica_transfer

    me, applied = int(os.environ["RANK"]), []
    train_step = fault_replica.ReplicaTrainer.train_step
    name = "apply_bias" if hasattr(MoELayer, "apply_bias") else "update_bias"  # (update_bias: the source before)
    apply_bias = getattr(MoELayer, name)

    def applying(self, *a):
        load = apply_bias(self, *a)
        applied.append(load.tolist())
        return load

    def stepping(self, s):
        applied.clear()
        out = train_step(self, s)
        Path(pid_dir, f"bias_{me}_{s + 1}.json").write_text(json.dumps(applied))
        return out

    setattr(MoELayer, name, applying)
    fault_replica.ReplicaTrainer.train_step = stepping
    if plant == "joiner_without_the_bias":
        receive = replica_transfer.receive_state

        def receiving(model, source, *a, **kw):
            fresh = [moe.router.expert_bias.clone() for moe in moe_layers(model.chunks)]
            out = receive(model, source, *a, **kw)
            for moe, bias in zip(moe_layers(model.chunks), fresh):
                moe.router.expert_bias.copy_(bias)
            return out

        replica_transfer.receive_state = receiving
    elif plant == "discarded_counts_kept":
        replica_kills.keep_counts_over_a_regroup(lambda trainer: moe_layers(trainer.model.chunks), "routed_since_update")
    elif plant:
        raise ValueError(f"plant={plant!r}; one of {PLANTS}")
    if skip:
        _skip_at(skip)
    return replica_kills.sigkill_at(rank, step, phase, pid_dir, *run_args, **kwargs)
