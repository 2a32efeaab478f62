"""Rank entry of the expert re-placement fault tests: ``replica_kills.sigkill_at``, recording each rank's expert
placement and load after every step it completes, with a planted bug if asked. Imported by name in the rank
processes (as ``replica_kills``)."""

import json
import os
from pathlib import Path

PLANTS = ("", "joiner_keeps_its_placement", "discarded_counts_kept")


def placed(plant: str, rank: int, step: int, phase: str, pid_dir: str, *run_args, **kwargs) -> dict:
    """``sigkill_at(rank, step, phase, pid_dir, *run_args, **kwargs)``; after each step it completes, every rank
    writes its layers' placement (``expert_at``) and its replacer's global load since the last re-placement to
    ``pid_dir/placement_<rank>_<step>.json`` (the launcher's numbering; a redone step's overwrites the discarded
    one's, were it written). ``plant``:
    ``"joiner_keeps_its_placement"``: a joiner routes by its own placement and load, not the ones it received;
    ``"discarded_counts_kept"``: a regrouped trainer keeps the routed pairs the discarded step counted."""
    import replica_kills
    from pretrain.training import fault_replica, replica_transfer

    me = int(os.environ["RANK"])
    train_step = fault_replica.ReplicaTrainer.train_step

    def stepping(self, s):
        out = train_step(self, s)
        experts = self.expert_replacer
        placements = [list(layer.placement.expert_at) for layer in experts.layers]
        loads = experts.state()[1] if hasattr(experts, "state") else experts.carried  # (the source before the fix)
        Path(pid_dir, f"placement_{me}_{s + 1}.json").write_text(json.dumps({"expert_at": placements, "load": loads}))
        return out

    fault_replica.ReplicaTrainer.train_step = stepping
    if plant == "joiner_keeps_its_placement":
        receive = replica_transfer.receive_state

        def receiving(model, source, control=None, experts=None):
            own = experts.state()  # a fresh trainer's: contiguous, nothing counted
            out = receive(model, source, control, experts)
            experts.adopt(own)
            return out

        replica_transfer.receive_state = receiving
    elif plant == "discarded_counts_kept":
        replica_kills.keep_counts_over_a_regroup(lambda trainer: trainer.expert_replacer.layers, "load_since_replace")
    elif plant:
        raise ValueError(f"plant={plant!r}; one of {PLANTS}")
    return replica_kills.sigkill_at(rank, step, phase, pid_dir, *run_args, **kwargs)
