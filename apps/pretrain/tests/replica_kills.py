"""Rank entries that SIGKILL one rank of a fault-tolerant run at a chosen step and phase; the patches live
in the rank processes only (imported by name there, as ``fault_ranks``)."""

import os
import signal
from pathlib import Path

PHASES = ("forward", "backward", "reduction", "optimizer", "save")


def _sha256(t) -> str:
    """A tensor's bytes' SHA-256, on any device and dtype (the benchmark runs on GPUs too)."""
    import hashlib

    import torch

    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _sigkill_node() -> None:
    """This rank's whole process group: under a launcher started in a session of its own, the node (launcher,
    forkserver and every rank)."""
    os.killpg(0, signal.SIGKILL)


def sigkill_at(rank: int, step: int, phase: str, pid_dir: str, *run_args, admit_before: int = 0, also: tuple = (),
               joiner_dies: bool = False, stale_step: bool = False, stall: tuple = (), whole_node: bool = False,
               inject: str = "", fence_check: bool = False) -> dict:
    """``run_rank(*run_args)``, except that ``rank`` (the launcher's numbering) SIGKILLs itself in ``phase`` of
    its (1-based) ``step``: the forward, the backward, the gradients' reduction (its first bucket's
    all-reduce), the optimizer step or the checkpoint save after it (its files written, before rank 0
    gathers the digests; a background save: in its publishing thread, while the next step trains). Every rank writes its pid to ``pid_dir`` first, and at the end the
    size and SHA-256 of every piece of state it owns to ``pid_dir/state_<rank>.json``. ``admit_before``: rank 0
    waits before that (1-based) step until the lost replica's replacement is ready (so the test does not race
    the replacement's start-up; and at every boundary after it while a replica is missing). ``also``: more
    (rank, step) pairs killed in the same phase, or (rank, step, phase) in that one ("regroup": in the regroup
    after a loss, before it arrives at the next generation). ``joiner_dies``: the first replacement SIGKILLs itself while it
    receives its state. ``stale_step``: the planted bug "a joiner with a stale optimizer step count": a joiner
    receiving its state point to point keeps its own fresh step count (no AdamW bias correction carried over).
    ``whole_node``: the kill is of the rank's whole process group (its node, under :func:`_sigkill_node`).
    ``stall``: (rank, step, phase, seconds) entries: that rank sleeps before its first all-reduce of that phase
    ("reduction"), or before it checks in as a survivor claiming a loss ("claim": it noticed the loss late), once.
    ``inject``: ``PAR_INJECT`` in every rank (a fault injected, pretrain.observe.inject).
    ``fence_check``: each rank started first (not a replacement) also writes ``rank_<rank>_<pid>``, and a survivor,
    once a loss's generation exists, writes ``fence_<rank>_<generation>``: the state of each of that loss's ranks' first
    processes then, by pid ("gone": reaped; else /proc's state letter, "Z": killed, not reaped), and a rank that lives
    to see a generation without it (it was not fenced first) writes ``unfenced_<rank>``.
    Every rank also writes its optimizer's step count at the end to ``pid_dir/optimizer_steps_<rank>``. In a
    regroup, an admission or a join, a host integer tensor sent over the default group (the device group, NCCL on
    GPUs) raises."""
    import json
    import time

    import torch.distributed as dist
    from par_groups import comm
    from par_zero.data_parallel import DataParallel

    from pretrain.runtime.replica_membership import ready_key
    from pretrain.training.fault_replica import ReplicaRun, ReplicaTrainer, owned_state
    from pretrain.training.owned_state import buddy_state
    from pretrain.training.run import run_rank
    from pretrain.training.train_loop import Trainer

    Path(pid_dir, str(os.getpid())).touch()
    if inject:
        from pretrain.observe.inject import ENV

        os.environ[ENV] = inject
    me, now = int(os.environ["RANK"]), {"step": 0}
    kills = {(rank, step, phase)} | {(r, s, *(p or (phase,))) for r, s, *p in also}

    def due(wanted: str, at: int | None = None) -> bool:
        at = now["step"] if at is None else at
        if (me, at, wanted) in kills:
            # once per (rank, step): a replacement that joins quickly may run that step again
            marker = Path(pid_dir, f"killed_{me}_{at}")
            if marker.exists():
                return False
            marker.touch()
            Path(pid_dir, f"killed_{me}_at").write_text(repr(time.time()))  # for the benchmark
            return True
        return False

    def stalled(wanted: str) -> None:  # once per (rank, step, phase): a redone step is not held again
        for r, s, p, seconds in stall:
            marker = Path(pid_dir, f"stalled_{me}_{s}_{p}")
            if (r, s, p) == (me, now["step"], wanted) and not marker.exists():
                marker.touch()
                time.sleep(seconds)

    train_step, forward_chunk, loss = ReplicaTrainer.train_step, ReplicaTrainer.forward_chunk, ReplicaTrainer.loss
    plain_step, plain_forward = Trainer.train_step, Trainer.forward_chunk
    all_reduce, dp_step = comm.all_reduce, DataParallel.step

    def stepping(self, s):
        now["step"] = s + 1
        out = train_step(self, s)
        if s + 1 == self.cfg.train.steps:
            state = {name: [[t.numel() * t.element_size(), _sha256(t)]
                            for t in boxes] for name, boxes in owned_state(self.model).items()}
            Path(pid_dir, f"state_{me}.json").write_text(json.dumps(state))
            buddy = {name: [[t.numel() * t.element_size(), _sha256(t)]
                            for t in boxes] for name, boxes in buddy_state(self.model).items()}
            Path(pid_dir, f"buddy_{me}.json").write_text(json.dumps(buddy))
            Path(pid_dir, f"optimizer_steps_{me}").write_text(str(self.model.dp.step_count))
        return out

    admit = ReplicaRun.admit

    def admitting(self, trainer, s):
        if admit_before and dist.get_rank() == 0:
            if s + 1 < admit_before:  # not yet, however fast the replacement started: the test pins the step
                missing, self.missing = self.missing, {}
                try:
                    return admit(self, trainer, s)
                finally:
                    self.missing = missing
            deadline = time.monotonic() + min(self.cfg.train.join_timeout_s, 120.0)  # bounded: one line, no hang
            while not all(self.store.check([ready_key(r) for r in ranks]) for ranks in self.missing.values()):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank 0: the replacement of {sorted(self.missing.values())} was not ready "
                                       f"before step {s + 1} within {min(self.cfg.train.join_timeout_s, 120.0):g} s")
                time.sleep(0.05)
        return admit(self, trainer, s)

    ReplicaRun.admit = admitting
    arrive = ReplicaRun._arrive

    def arriving(self, event):  # the "regroup" phase: before this rank arrives at the next generation
        if due("regroup"):
            _sigkill()
        return arrive(self, event)

    ReplicaRun._arrive = arriving
    if fence_check:
        from pretrain.runtime.replica_membership import JOIN_ENV

        if JOIN_ENV not in os.environ:
            Path(pid_dir, f"rank_{me}_{os.getpid()}").touch()
        next_generation = ReplicaRun._next_generation

        def checking(self, error):  # the lost replica's first processes, once the generation without it exists
            try:
                event = next_generation(self, error)
            except RuntimeError as e:
                if "membership" in str(e):
                    Path(pid_dir, f"unfenced_{me}").write_text(str(e))
                raise
            states = {}
            for pid in (p.name.split("_")[2] for r in event.get("lost", []) for p in Path(pid_dir).glob(f"rank_{r}_*")):
                try:
                    states[pid] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                except OSError:
                    states[pid] = "gone"
            Path(pid_dir, f"fence_{me}_{self.generation}").write_text(json.dumps(states))
            return event

        ReplicaRun._next_generation = checking
    claim_loss = ReplicaRun._claim_loss

    def claiming(self):  # the "claim" stall: a survivor that checks in late
        stalled("claim")
        return claim_loss(self)

    ReplicaRun._claim_loss = claiming
    control = {"depth": 0}  # inside the fault tolerance's own traffic: a regroup, an admission, a join

    def controlled(method):
        def inside(*a, **kw):
            control["depth"] += 1
            try:
                return method(*a, **kw)
            finally:
                control["depth"] -= 1
        return inside

    for name in ("regroup", "admit", "_joined"):
        setattr(ReplicaRun, name, controlled(getattr(ReplicaRun, name)))
    from pretrain.training import fault_replica

    reshard = fault_replica.reshard_state

    def resharding(old, new, done, *group):  # buddy shards: every group but the control group is a device group
        control["reshard"] = group[0] if group else None
        try:
            return reshard(old, new, done, *group)
        finally:
            control.pop("reshard")

    fault_replica.reshard_state = resharding

    def device_group_only(group, tensors, device: bool | None = None) -> None:
        """The default group stands for the device group, NCCL on GPUs, which takes no host tensor: the control
        traffic's integers (the agreement, an admission's flag, a transfer's sizes and digests) must not go there.
        ``device``: whether ``group`` is a device group, if not only the default one is."""
        device = group is None if device is None else device
        if control["depth"] and device and any(t.is_cpu and not t.is_floating_point() for t in tensors):
            raise RuntimeError("a host control tensor sent over the device group (NCCL refuses it)")
    from pretrain.checkpoint import store

    gather_digests = store.gather_digests

    def gathering(*a, **kw):
        if due("save"):
            _sigkill()
        return gather_digests(*a, **kw)

    store.gather_digests = gathering
    from pretrain.checkpoint import background

    publish = background.PendingSave._publish

    def publishing(self):  # a background save: in its publishing thread, its files written, the step's own
        if due("save", int(self.state["step"])):
            _sigkill()
        return publish(self)

    background.PendingSave._publish = publishing
    if stale_step:
        from pretrain.training import replica_transfer

        receive = replica_transfer.receive_state

        def stale(model, source, *a):
            fresh = model.dp.step_count
            out = receive(model, source, *a)
            model.dp.step_count = fresh
            return out

        replica_transfer.receive_state = stale
    if joiner_dies:
        from pretrain.training import replica_transfer

        receive_state = replica_transfer.receive_state

        def dying(trainer, source, *a):
            marker = Path(pid_dir, "joiner_died")
            if not marker.exists():
                marker.touch()
                _sigkill()
            return receive_state(trainer, source, *a)

        replica_transfer.receive_state = dying
        from pretrain.training import fault_replica

        reshard_state = fault_replica.reshard_state

        def dying_in_reshard(old, new, *a):  # buddy shards: the joiner (old is None) re-shards, receiving
            marker = Path(pid_dir, "joiner_died")
            if old is None and not marker.exists():
                marker.touch()
                _sigkill()
            return reshard_state(old, new, *a)

        fault_replica.reshard_state = dying_in_reshard

    def forwarding(self, *a, **kw):
        if due("forward"):
            _sigkill_node() if whole_node else _sigkill()
        return forward_chunk(self, *a, **kw)

    def lossing(self, *a, **kw):
        out = loss(self, *a, **kw)
        if due("backward") and out.requires_grad:
            out.register_hook(lambda grad: _sigkill())
        return out

    def reducing(tensor, *a, **kw):
        device_group_only(a[0] if a else kw.get("group"), [tensor])
        if tensor.numel() > 1 and due("reduction"):  # not a count (eod_mask_loss's kept tokens)
            _sigkill()
        if tensor.numel() > 1:
            stalled("reduction")
        return all_reduce(tensor, *a, **kw)

    def updating(self, *a, **kw):
        if due("optimizer"):
            _sigkill()
        return dp_step(self, *a, **kw)

    def plain_stepping(self, s):  # without fault tolerance (the benchmark's restart): the forward only
        now["step"] = s + 1
        return plain_step(self, s)

    def plain_forwarding(self, *a, **kw):
        if due("forward"):
            _sigkill()
        return plain_forward(self, *a, **kw)

    ReplicaTrainer.train_step, ReplicaTrainer.forward_chunk, ReplicaTrainer.loss = stepping, forwarding, lossing
    if phase == "forward":
        Trainer.train_step, Trainer.forward_chunk = plain_stepping, plain_forwarding
    batch_isend_irecv = comm.batch_isend_irecv

    def point_to_point(ops):
        device_group_only(ops[0].group, [op.tensor for op in ops])
        return batch_isend_irecv(ops)

    all_gather_into_tensor = comm.all_gather_into_tensor

    def gathering_into(output, input, group, *a, **kw):  # in a buddy re-shard: a gather is metadata (the state is
        # all-reduced as its bits), and every group but the control group a device group (its data-parallel one)
        device_group_only(group, [input], group is None or group is not control.get("reshard", group))
        return all_gather_into_tensor(output, input, group, *a, **kw)

    comm.all_reduce, DataParallel.step, comm.batch_isend_irecv = reducing, updating, point_to_point
    comm.all_gather_into_tensor = gathering_into
    return run_rank(*run_args)


def keep_counts_over_a_regroup(layers_of, attr: str) -> None:
    """The planted bug "a discarded step's counts kept": a regrouped trainer adds back the counts (``attr`` of each of
    ``layers_of(trainer)``) the interrupted step had made on the old trainer, which the fix discards."""
    from pretrain.training import fault_replica

    held, copy_state = fault_replica.HeldState.of, fault_replica.copy_state
    kept = {}

    def holding(trainer):
        kept["counts"] = [getattr(layer, attr).clone() for layer in layers_of(trainer)]
        return held(trainer)

    def copying(src, dst):
        copy_state(src, dst)
        for layer, counts in zip(layers_of(dst), kept.pop("counts", [])):
            getattr(layer, attr).add_(counts)

    fault_replica.HeldState.of, fault_replica.copy_state = holding, copying


def injected(spec: str, pid_dir: str, *run_args) -> dict:
    """``run_rank(*run_args)`` with ``PAR_INJECT=spec`` in this rank (pretrain.observe.inject); every rank
    writes its pid to ``pid_dir`` first (a replacement too: none must start for a condemned replica)."""
    from pretrain.observe.inject import ENV
    from pretrain.training.run import run_rank

    Path(pid_dir, str(os.getpid())).touch()
    os.environ[ENV] = spec
    return run_rank(*run_args)
