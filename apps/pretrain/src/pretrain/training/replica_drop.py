"""Under ``[train].fault_tolerance = "replica"``, a rank the corruption check finds computing wrong results
persistently, or holding a copy of the state unlike its replicas' (integrity.py), takes its replica out of the
run instead of stopping it.

Every rank reaches the same verdict at the same log step, before that step's update is applied (the
step is discarded, as a step interrupted by a death). The ranks of the suspect's replica mark themselves
condemned in the launcher's store and exit; the launcher fences the replica as for a death and does not
start a replacement for it even with ``[train].respawn`` (a replacement would run on the same device,
which computes wrong: a GPU that failed this check should come back only once a person has looked at
it). The others regroup without it, redo the step with its micro-batches split among them (what the
discarded step left, as a non-finite loss the odd rank caused, is forgotten), and log the verdict
(``"event": "corruption"``) next to ``replica_lost``. A replica split over launchers is fenced by each for its
ranks (runtime/node_fences.py), and none starts its share again.
"""

from __future__ import annotations

import os
import sys

import torch

from ..runtime.replica_membership import condemned_key

LEFT = 3  # the exit code of a condemned rank (the launcher takes it for a death, as it does any)


def drop_replica(run, trainer, step: int, error) -> int:
    """After ``error`` (an ``integrity.PersistentRank``) in step ``step``: exits in the suspect's replica;
    elsewhere regroups and returns the step the survivors go on from (``ReplicaRun.regroup``)."""
    if trainer.groups.coords()["dp"] // run.shard == error.dp // run.shard:
        run.store.set(condemned_key(run.rank), error.event["host"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(LEFT)  # no teardown: the survivors have left the collectives that would wait for it
    event, before = dict(error.event), set(run.missing)
    seen = trainer.non_finite.first  # a non-finite loss or norm of the discarded step is not the redone step's
    seen.copy_(torch.where(seen[0] >= step, torch.full_like(seen, -1.0), seen))
    done = run.regroup(trainer, step, error)
    for replica in set(run.missing) - before:  # never admitted again: nothing to wait for at each boundary
        del run.missing[replica]
    if run.logger is not None:
        kind, at = event.pop("event"), event.pop("step")
        run.logger.log_event(kind, step=at, **event, replica_dropped=True)
        what = "an odd copy" if event["class"] == "odd_copy" else "persistent"
        run.logger.message(f"step {at}: corruption check: {what} on rank {event['rank']} (host {event['host']}, "
                           f"GPU {event['gpu']}); its replica is dropped and the step redone without it")
    return done
