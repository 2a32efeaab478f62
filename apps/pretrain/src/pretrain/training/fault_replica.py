"""A rank's side of ``[train].fault_tolerance = "replica"``: the step goes on without a lost replica, with
the same batch and the same math.

Each step's global batch is ``M = global_batch / micro_batch`` micro-batches (a pure function of the
step: ``data/sampler.py``). With every replica alive, replica ``d`` of ``D`` trains micro-batches
``d * M / D ...``, as without fault tolerance. When replicas are lost, the ``D'`` survivors split the
same ``M`` micro-batches in contiguous runs (uneven when ``D'`` does not divide ``M``) as extra
accumulation, and each micro-batch's loss is weighted ``D' / M``: the data-parallel reduction divides
by ``D'``, so the gradient is the mean over the global batch's micro-batches, never over participants,
and the logged loss the same global mean.

On a failed collective (:class:`ReplicaRun`'s :meth:`~StepRange.attempt`), the survivor leaves every process group,
waits for the launcher's next generation (:mod:`pretrain.runtime.replica_membership`), joins a new
default group over that generation's fresh store prefix, builds a new :class:`ReplicaTrainer` for the
smaller world, copies its own state into it (weights, fp32 masters, optimizer state and step, re-placed
experts' placement and load; this process's RNG is untouched), and the step loop goes on from the step
boundary every survivor agrees on: the interrupted step is discarded and redone.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from par_groups import comm

from ..checkpoint.rng_state import rng_state, set_rng_state
from ..config.fault_rules import replica_data_ranks
from ..data.sampler import Batch
from ..errors import UsageError
from ..runtime.rank_env import LAUNCHER_ENV
from ..runtime.launch import cpu_threads, device_type
from ..runtime.member_beats import MemberBeat, Silence
from ..runtime.replica_membership import (CLAIM_ENV, JOIN_ENV, alive_key, claim, claimable, coords_key,
                                          generation_key, generation_prefix, latest_generation, lost_by_replica,
                                          ready_key, replica_key, returned_key, survivors_event)
from .dynamic_cp import led_pieces
from .generation_sockets import open_sockets, shut_down
from .integrity import PersistentRank
from .micro_batches import NO_DOCUMENTS
from .owned_state import owned_state
from .preflight import checkpoint_root
from .replica_drop import drop_replica
from .replica_padding import padded, padding, pads
from .replica_reshard import reshard_state
from .replica_saves import agreed_unpublished, holders, reopen, take_save, unpublished
from .train_loop import Trainer

MODEL_PARALLEL = ("tp", "cp", "ep", "pp")  # a replica's block: one rank at each of these coordinates
ORIGINAL_RANK = "PRETRAIN_FT_RANK"  # a replacement's rank in the launcher's numbering (RANK: its generation's)
ORIGINAL_WORLD = "PRETRAIN_FT_WORLD"
ADMITTED = "PRETRAIN_FT_ADMITTED"  # a replacement: the membership it was admitted with (JSON)
SETTLE_S = 5.0  # survivors claiming a loss (CLAIM_ENV): a member whose heartbeat has not moved for this long is lost

# What a surviving rank reads when a peer died under a collective (gloo; NCCL: an error or the timeout), in
# lower case: gloo says "Timed out waiting ... for recv" where a dead peer's socket was never closed to it
PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker crashing",
             "timed out", "timeout", "nccl communicator was aborted", "distbackenderror")


@dataclass(frozen=True)
class ReplicaShare:
    """Which of a step's ``M`` global micro-batches replica ``index`` of ``alive`` trains: ``[first, last)``."""

    global_batch: int
    micro_batch: int
    alive: int  # replicas training (D')
    index: int  # this replica's place among them

    @property
    def microbatches(self) -> int:  # M
        return self.global_batch // self.micro_batch

    @property
    def first(self) -> int:
        return self.index * self.microbatches // self.alive

    @property
    def last(self) -> int:
        return (self.index + 1) * self.microbatches // self.alive

    @property
    def count(self) -> int:
        return self.last - self.first

    @property
    def weight(self) -> float:
        """Each micro-batch's loss factor on top of the accumulation's ``1 / count``: ``count * D' / M``
        (1 exactly while every replica trains)."""
        return 1.0 if self.count * self.alive == self.microbatches else self.count * self.alive / self.microbatches

    def samples(self, step: int) -> range:
        """The global sample ids this replica trains at ``step`` (0-based)."""
        base = step * self.global_batch
        return range(base + self.first * self.micro_batch, base + self.last * self.micro_batch)


class ReplicaTrainer(Trainer):
    """A :class:`Trainer` that reads its :class:`ReplicaShare` of each global batch and weights its losses so."""

    drops_replicas = True  # a persistent rank's replica leaves the run (replica_drop.py)

    def __init__(self, cfg, share: ReplicaShare, sample_log: Path | None = None, **kwargs) -> None:
        self.share, self.sample_log = share, sample_log
        self.completed: int | None = None  # steps done (set after each step: a failure after it keeps it)
        self.generation = 0
        super().__init__(cfg, **kwargs)
        optimizer = self.model.dp.optimizer_state
        if hasattr(optimizer, "collectives_first"):  # a step interrupted in its collectives changed no state
            optimizer.collectives_first = True
        if getattr(self.model.dp, "buddy_optimizer", None) is not None:  # ZeRO-1 buddies: the params' gather
            self.model.dp.defer_param_sync = True  # opens the next step, so a step's update is whole or not begun
        for counts in self._step_counts():  # summed before the update: alike on every replica at each boundary
            counts.fold_each_step()

    def _step_counts(self) -> list:
        """What counts routed pairs per step for use after the update: the expert replacer, the bias balancing."""
        return [c for c in (self.expert_replacer, self.bias_balance) if c is not None]

    @property
    def loss_weight(self) -> float:
        """Each micro-batch's loss factor: none under eod_mask_loss or dynamic CP, whose loss is divided by the global
        batch's kept count per micro-batch of this rank already (train_loop.py), whatever share each replica trains;
        under ZeRO-3 over the whole dp, the real micro-batches' of a padded share (replica_padding.py)."""
        if self.cfg.data.eod_mask_loss or self.span_groups is not None:
            return 1.0
        if not pads(self.cfg):
            return self.share.weight
        s, n = self.share, self.share.count + padding(self.share)
        return 1.0 if n * s.alive == s.microbatches else n * s.alive / s.microbatches

    def rerun_batch(self, dp: int, step: int) -> Batch:
        return self._read_batch(step, share=replace(self.share, index=dp))

    def _read_batch(self, step: int, eval: bool | str = False, share: ReplicaShare | None = None) -> Batch:
        """The share's micro-batches; under dynamic CP the whole global batch ``[global_batch, seq_len + 1]``: every
        rank plans all of it over this generation's dp x cp ranks (dynamic_cp.py), however many replicas are left."""
        s, share = self.sampler, share or self.share
        stream = (s.test if eval == "test" else s.valid) if eval else s.train
        if self.span_groups is not None:
            return stream.gather(step * share.global_batch, (step + 1) * share.global_batch)
        ids = share.samples(step)
        batch = stream.gather(ids.start, ids.stop)
        shape = (share.count, share.micro_batch, s.seq_len + 1)
        batch = Batch(batch.tokens.reshape(shape), batch.segments.reshape(shape))
        return padded(batch, padding(share)) if pads(self.cfg) else batch

    def _counted(self, n: int) -> int:
        """The real micro-batches of a padded share: a padding copy's predictions are not in the global batch."""
        return self.share.count if pads(self.cfg) and n == self.share.count + padding(self.share) else n

    def loss(self, out, labels, batch=NO_DOCUMENTS):
        loss = super().loss(out, labels, batch)
        ys, real = getattr(batch, "labels", ()), self.share.count  # a padded batch: its real micro-batches, then copies
        if pads(self.cfg) and len(ys) == real + padding(self.share) and any(labels is y for y in ys[real:]):
            return loss * 0.0  # a padding micro-batch (replica_padding.py): zero gradients, 0 in the mean
        return loss if self.loss_weight == 1.0 else loss * self.loss_weight

    def forward_chunk(self, batch, chunk_id, module, x, microbatch):
        m = self.cfg.model
        if m.hidden_dropout > 0 or m.attention_dropout > 0:  # the masks of the global samples this micro-batch holds
            first = self.share.samples(self._step).start + microbatch * self.share.micro_batch
            self.model.dropout.set(self.cfg.train.seed, self._step, first)
        with self.fp8_region():
            return module(x, docs=batch.docs[microbatch]) if batch.docs else module(x)

    def _dynamic_microbatches(self, batch):
        if self.sample_log is not None:  # the pieces this rank names in the sample log
            self._led = led_pieces(batch, self.cfg.parallel.max_seq_per_rank, self.span_groups)
        return super()._dynamic_microbatches(batch)

    def train_step(self, step: int):
        self.sync_params()
        self._training = True
        try:
            result = super().train_step(step)
        finally:
            self._training = False
        for counts in self._step_counts():  # a skipped update's counts count too, as without fault tolerance
            counts.commit()
        self.completed = step + 1
        return result

    def sync_params(self) -> None:
        """The params gathered from the last step's update where it was left to the next step (buddies)."""
        if getattr(self.model.dp, "params_stale", False):
            self.model.dp.sync_params()

    def evaluate(self, batches: int, split: str = "valid") -> float:
        self.sync_params()
        return super().evaluate(batches, split)

    def _mean_loss(self, losses, also=None):
        """The global mean loss; in a training step, its reduction is the last of the step's gradient's
        collectives: this replica's samples are in the step's gradient now (logged when asked)."""
        loss = super()._mean_loss(losses, also)
        for counts in self._step_counts() if getattr(self, "_training", False) else ():  # before the update: a
            counts.count_step()  # failed summation leaves the step discarded with nothing changed
        if getattr(self, "_training", False) and self.sample_log is not None:
            with open(self.sample_log, "a") as f:
                f.write(json.dumps({"step": self._step + 1, "generation": self.generation} | self._samples()) + "\n")
        return loss

    def _samples(self) -> dict:
        """This rank's record of the step's gradient: its replica's samples; under dynamic CP the pieces whose block
        it leads (sequence, start, end, span; every piece of the global batch is led by one rank of the plan), the
        samples whose first piece is among them, and the dp x cp ranks planned over."""
        if self.span_groups is None:
            return {"samples": list(self.share.samples(self._step))}
        base = self._step * self.share.global_batch
        return {"samples": [base + g for g, start, _, _ in self._led if start == 0], "width": len(self.span_groups.ranks),
                "pieces": [[base + g, start, end, span] for g, start, end, span in self._led]}


@dataclass(frozen=True)
class HeldState:
    """A trainer's state alone (its owned tensors, optimizer kinds, scalars and counts), without the trainer: the
    old generation's groups, held by its modules, buckets and pending works, go once the trainer is let go."""

    kinds: tuple
    owned: dict
    step_count: int
    scalars: dict
    non_finite: object
    completed: int | None
    experts: tuple | None = None  # ExpertReplacer.state: placement and load, a discarded step's not counted
    bias: list | None = None  # BiasBalance.state: the kept counts of skipped updates, a discarded step's not counted

    @classmethod
    def of(cls, trainer) -> "HeldState":
        dp, replacer = trainer.model.dp, trainer.expert_replacer
        return cls(tuple(dp.optimizer_state.state_kinds()), owned_state(trainer.model), dp.step_count,
                   dp.optimizer_state.scalar_state(), trainer.non_finite, trainer.completed,
                   None if replacer is None else replacer.state(),
                   None if trainer.bias_balance is None else trainer.bias_balance.state())


def let_go(trainer) -> HeldState:
    """``trainer``'s state, and the trainer emptied to what a regroup reads (the state held among it, should
    another loss interrupt this regroup): a survivor's old groups close now, so a survivor still in one of
    their collectives (two survivors of a group with lost ranks, as dp x cp's) fails at once, not at its
    timeout, while this one waits for the next generation."""
    if "held" in trainer.__dict__:  # emptied by a regroup a loss interrupted
        return trainer.held
    held = HeldState.of(trainer)
    if trainer.prefetch is not None:
        trainer.prefetch.close()
    trainer.__dict__ = {"share": trainer.share, "sample_log": trainer.sample_log, "completed": trainer.completed,
                        "coords": trainer.groups.coords(), "held": held}
    return held


@torch.no_grad()
def copy_state(src: HeldState, dst) -> None:
    """``dst`` (a fresh trainer of the same model-parallel layout) takes ``src``'s state, in this process."""
    if src.experts is not None:  # first: the pieces (boxes of the full tensors) follow from the placement
        dst.expert_replacer.adopt(src.experts)  # the slots hold what they held: route by the same placement
    if dst.bias_balance is not None:  # the bias itself is a buffer of the owned state
        dst.bias_balance.adopt(src.bias)
    dst.model.dp.optimizer_state.prepare_load(src.kinds)
    a, b = src.owned, owned_state(dst.model)
    if a.keys() != b.keys():
        raise RuntimeError(f"regrouped trainer holds other state: {sorted(a.keys() ^ b.keys())[:4]}")
    for name, boxes in a.items():
        for x, y in zip(boxes, b[name], strict=True):
            y.copy_(x)
    dst.model.dp.sync_params()
    dst.model.dp.step_count = src.step_count
    dst.model.dp.optimizer_state.finish_load(src.scalars)
    dst.non_finite, dst.completed = src.non_finite, src.completed


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is what a collective raises when a peer is gone."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{type(error).__name__}: {error}".lower()
        if any(marker in text for marker in PEER_LOST):
            return True
        error = error.__cause__ or error.__context__
    return False


class ReplicaRun:
    """This rank's membership across generations: makes the trainers, regroups them after a loss, admits
    replacements at step boundaries (``[train].respawn``), and, in a replacement, joins a running generation."""

    def __init__(self, cfg, stops, device: torch.device) -> None:
        if LAUNCHER_ENV not in os.environ:  # torchrun without the job's store (runtime/torchrun_replica.py)
            raise UsageError("[train].fault_tolerance='replica' runs under pretrain's own launcher "
                             "(`pretrain train --nproc N`), or under torchrun with `pretrain train --nnodes N "
                             "--node-rank K --rdzv-endpoint HOST:PORT` naming `pretrain store`'s; set it to 'off' there")
        self.cfg, self.stops, self.device = cfg, stops, device
        self.rank = int(os.environ.get(ORIGINAL_RANK, dist.get_rank()))  # generation 0's numbering: the launcher's
        os.environ[ORIGINAL_RANK] = str(self.rank)  # what PAR_INJECT names (observe/inject.py), after any regroup
        self.layout = cfg.validate_world(int(os.environ.get(ORIGINAL_WORLD, dist.get_world_size())))
        self.store = _store(cfg)
        admitted = os.environ.get(ADMITTED)
        self.admitted = json.loads(admitted) if admitted else None  # a replacement: the generation it joined
        self.generation = self.admitted["generation"] if self.admitted else 0
        self.missing: dict[int, list[int]] = {}  # lost replicas (their ranks) waiting for a replacement
        self.losses: list[tuple[int, dict]] = []  # (generation, membership) of each loss passed, logged at the agreement
        self.joined_at: int | None = None
        self.kwargs: dict = {}
        self.replica = -1
        self.shard = _shard_size(cfg, self.layout.dp)  # data ranks per replica: an HSDP replica's sharding group
        self.logger = None
        self.sockets = open_sockets()  # this generation's connections: its default and stop groups' so far
        self.saver = None  # the run's CheckpointSaver: its background save and group follow the generations
        # where the survivors claim a loss, they wait for every member still beating (runtime/member_beats.py)
        self.beat = MemberBeat(lambda: _store(cfg), self.rank) if os.environ.get(CLAIM_ENV) else None

    def trainer(self, cfg, **kwargs) -> ReplicaTrainer:
        """This rank's first trainer: generation 0's (every replica alive; publishes this rank's replica and
        coordinates for the launcher and later replacements), or a replacement's, filled from a live replica."""
        self.kwargs = kwargs
        if self.admitted is not None:
            return self._joined(self.admitted)
        layout = self.layout
        share = ReplicaShare(cfg.train.global_batch, layout.micro_batch, layout.dp, 0)
        before = open_sockets()
        trainer = ReplicaTrainer(cfg, share, **kwargs)
        self.sockets |= open_sockets() - before  # its groups'
        self.replica = trainer.groups.coords()["dp"] // self.shard
        trainer.share = replace(share, index=trainer.groups.coords()["dp"])
        trainer.sample_log = self._sample_log(trainer.groups.coords())
        _fresh_prefix(self.store, 0, self.layout.world_size)
        self.store.set(coords_key(self.rank), json.dumps(trainer.groups.coords()))
        self.store.set(replica_key(self.rank), str(self.replica))
        return trainer

    def _joined(self, event: dict) -> ReplicaTrainer:
        from .replica_transfer import receive_state

        began = time.monotonic()
        self.replica = event["replicas"][str(self.rank)]
        fresh = self._generation_trainer(event, self._coords(self.rank), ReplicaShare(
            self.cfg.train.global_batch, self.layout.micro_batch, 1, 0), self._sample_log(self._coords(self.rank)))
        if self.cfg.train.buddy_shards:  # ZeRO-1 re-sharded over the new generation (replica_reshard.py)
            step, got = reshard_state(None, fresh, -1, self.control)
        else:
            (step, _), got = receive_state(fresh.model, self._pairs(event)[self.rank], self.control,
                                           fresh.expert_replacer, _block(self._coords(self.rank), self.shard),
                                           fresh.bias_balance), 0
        fresh.completed = step
        self.joined_at = self._agree(step, event, began, got)
        self.missing = {int(r): v for r, v in event.get("missing", {}).items()}
        return fresh

    def _coords(self, rank: int) -> dict:
        return json.loads(self.store.get(coords_key(rank)))

    def _sample_log(self, coords: dict) -> Path | None:
        if not self.cfg.log.sample_ids or coords["tp"] or coords["pp"] or coords["cp"] and not self.cfg.parallel.dynamic_cp:
            return None  # one rank per replica writes; under dynamic CP each cp rank, naming the pieces it leads
        folder = Path(self.cfg.log.dir) / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"rank_{self.rank}.jsonl"

    def log(self, logger, reopen) -> "ReplicaLog":
        """The run's log on every rank: its holder's ``logger``, reopened with ``reopen(step)`` by the next
        holder when the holder's replica is lost."""
        holder = self.admitted["log_holder"] if self.admitted else 0
        self.logger = ReplicaLog(logger if self.admitted is None else None, reopen, holder, self.rank)
        return self.logger

    def steps(self, start: int, stop: int, trainer) -> "StepRange":
        return StepRange(self, start, stop, trainer)

    # ---- regrouping ------------------------------------------------------------------------
    def regroup(self, trainer: ReplicaTrainer, step: int, error: BaseException | None, event: dict | None = None) -> int:
        """After ``error`` in step ``step`` (or at the boundary before ``step`` to admit ``event``'s replacement):
        the next generation's groups and trainer, adopted in place by ``trainer``; returns the step every
        member goes on from."""
        from .replica_transfer import send_state

        began = time.monotonic()
        done = trainer.completed if trainer.completed == step + 1 else step
        coords = trainer.coords if "held" in trainer.__dict__ else trainer.groups.coords()
        buddies = bool(self.cfg.train.buddy_shards)  # ZeRO-1 re-sharded over the new generation (replica_reshard.py)
        held = None if buddies else let_go(trainer)
        pending = take_save(self.saver, error)  # a background save of the old generation
        _leave_groups(error, self.stops, *holders(self.saver, pending))
        if error is not None:  # a survivor still in one of this generation's collectives on this rank fails now
            shut_down(self.sockets, int(os.environ["MASTER_PORT"]))
        self.sockets = set()
        unsaved = unpublished(pending)
        if event is None:
            event = self._next_generation(error)
        else:
            self.missing.pop(event["joined_replica"], None)
        event = self._arrive(event)
        alive = sorted(set(event["replicas"].values()))
        share = ReplicaShare(trainer.share.global_batch, trainer.share.micro_batch, len(alive) * self.shard,
                             _data_index(alive, self.replica, coords, self.shard))
        fresh = self._generation_trainer(event, coords, share, trainer.sample_log)
        if buddies:
            reshard_state(trainer, fresh, done, self.control)
            fresh.non_finite, fresh.completed = trainer.non_finite, trainer.completed
            if fresh.bias_balance is not None:  # the bias itself is re-sharded with the model's buffers
                fresh.bias_balance.adopt(trainer.bias_balance.state())
            if trainer.prefetch is not None:
                trainer.prefetch.close()
        else:
            copy_state(held, fresh)
        trainer.__dict__ = fresh.__dict__  # every holder of the trainer (the loop, the saver) sees the new one
        sent = 0
        for joiner, source in self._pairs(event).items() if not buddies else ():
            if source == self.rank:
                sent += send_state(trainer.model, self._new_rank(event, joiner), done, self.control,
                                   trainer.expert_replacer, _block(coords, self.shard), trainer.bias_balance)
        agreed = self._agree(done, event, began, sent, timed_out=error is not None and "timed out" in str(error).lower())
        reopen(self.saver, self.cfg.train.collective_timeout_s)
        unsaved = agreed_unpublished(self.saver, unsaved, error, self.control)
        if error is not None and dist.get_rank() == 0:
            _discard_save(self.cfg, agreed)
            if unsaved is not None:
                _discard_save(self.cfg, unsaved)
        if unsaved is not None:  # the save a loss interrupted, written again (at the agreed step: the state now)
            self.saver.save(trainer.checkpointed(), checkpoint_root(self.cfg), agreed, self.cfg.checkpoint.keep)
            if self.logger is not None:
                self.logger.message(f"checkpoint of step {unsaved} interrupted by the loss; saving step {agreed} again")
        return agreed

    def _generation_trainer(self, event: dict, coords: dict, share: ReplicaShare, sample_log) -> ReplicaTrainer:
        """Join ``event``'s process group (a fresh store prefix) and build its trainer (the run's config once built)."""
        alive = sorted(set(event["replicas"].values()))
        share = replace(share, alive=len(alive) * self.shard, index=_data_index(alive, self.replica, coords, self.shard))
        # a pipeline's schedule runs this replica's micro-batches, with their padding on every stage
        cfg = self._config(len(alive), share.count + (padding(share) if pads(self.cfg) else 0))
        before = open_sockets()
        if not dist.is_initialized():  # (this rank counted itself in the generation's prefix on arrival)
            rank = _position(cfg.validate_world(len(event["ranks"])).grid, coords,
                             _data_index(alive, self.replica, coords, self.shard))
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    store=dist.PrefixStore(generation_prefix(self.generation), self.store), rank=rank,
                                    world_size=len(event["ranks"]), timeout=timedelta(seconds=cfg.train.collective_timeout_s))
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(len(event["ranks"])))
            self.stops.group = dist.new_group(backend="gloo",
                                              timeout=timedelta(seconds=min(cfg.train.collective_timeout_s, 30.0)))
        rng = rng_state()  # a fresh trainer seeds torch: this process's stream goes on as it was
        fresh = ReplicaTrainer(cfg, share, sample_log, **self.kwargs)
        set_rng_state(rng)
        self.sockets |= open_sockets() - before  # this generation's groups'
        fresh.cfg, fresh.generation = self.cfg, self.generation  # the run's config: its schedule, its checkpoints
        return fresh

    def _new_rank(self, event: dict, rank: int) -> int:
        alive = sorted(set(event["replicas"].values()))
        grid = self._config(len(alive)).validate_world(len(event["ranks"])).grid
        coords = self._coords(rank)
        return _position(grid, coords, _data_index(alive, event["replicas"][str(rank)], coords, self.shard))

    def _pairs(self, event: dict) -> dict[int, int]:
        """Each replacement's source: the rank of the first other live replica at its model-parallel coordinate."""
        joined = set(event.get("joined", ()))
        pairs = {}
        for j in sorted(joined):
            mine = self._coords(j)
            sources = [r for r in event["ranks"] if r not in joined and _same_block(self._coords(r), mine, self.shard)]
            pairs[j] = min(sources, key=lambda r: event["replicas"][str(r)])
        return pairs

    @property
    def control(self):
        """The group of this generation's control traffic (the agreement, an admission's flag, a transfer's sizes,
        digests and host tensors): its gloo group over every member, made with the generation (the stop
        requests' too), so the device groups may be NCCL, which refuses host tensors."""
        return self.stops.group

    def _agree(self, done: int, event: dict, began: float, sent: int = 0, timed_out: bool = False) -> int:
        """Every member goes on from the same step (the collective checks it); logs the event, with how many
        members noticed a loss only at a collective's timeout (``timed_out``: this one) rather than at once."""
        agreed = torch.tensor([done, -done], dtype=torch.int64)
        moved = torch.tensor([sent, int(timed_out)], dtype=torch.int64)
        comm.all_reduce(agreed[:2], self.control, op=dist.ReduceOp.MAX)
        comm.all_reduce(moved, self.control)
        if int(agreed[0]) != -int(agreed[1]):
            raise RuntimeError(f"generation {self.generation}'s members stopped at different steps "
                               f"({-int(agreed[1])} and {int(agreed[0])})")
        losses, self.losses = self.losses, []
        if self.logger is not None:
            still = round(time.monotonic() - began, 3)
            for generation, lost in losses:  # every loss passed, the last one included
                self.logger.regrouped(lost, done)
                node = {"node": lost["node"]} if "node" in lost else {}  # lost whole (its heartbeat stopped)
                self.logger.log_event("replica_lost", step=done, ranks=lost["lost"], replica=lost["lost_replica"],
                                      generation=generation, replicas_left=len(set(lost["replicas"].values())),
                                      stood_still_s=still, noticed_at_timeout=int(moved[1]), **node)
            if "joined" in event:
                self.logger.log_event("replica_joined", step=done, ranks=event["joined"], replica=event["joined_replica"],
                                      generation=self.generation, stood_still_s=still, bytes_moved=int(moved[0]))
        return done

    def admit(self, trainer: ReplicaTrainer, step: int) -> None:
        """At the boundary before ``step``, while a replica is missing: rank 0 admits its replacement once
        every rank of it waits (a collective tells the others)."""
        event = None
        if dist.get_rank() == 0:
            for replica, ranks in sorted(self.missing.items()):
                if self.store.check([ready_key(r) for r in ranks]):
                    event = self._admission(replica, ranks, trainer)
                    break
        flag = torch.tensor([0 if event is None else self.generation], dtype=torch.int64)  # the generation claimed
        comm.all_reduce(flag, self.control, op=dist.ReduceOp.MAX)
        if int(flag[0]):
            if event is None:
                self.generation = int(flag[0])
                event = json.loads(self.store.get(generation_key(self.generation)))
            self.regroup(trainer, step, None, event)

    def _admission(self, replica: int, ranks: list[int], trainer) -> dict | None:
        """Claim the next generation for the current members and ``replica``'s replacement (None: a loss took it)."""
        current = json.loads(self.store.get(generation_key(self.generation)))
        members = sorted(current["ranks"] + ranks)
        replicas = current["replicas"] | {str(r): replica for r in ranks}
        missing = {str(k): v for k, v in self.missing.items() if k != replica}
        event = {"ranks": members, "replicas": replicas, "joined": sorted(ranks), "joined_replica": replica,
                 "missing": missing, "log_holder": self.logger.holder if self.logger else 0}
        if not claim(self.store, self.generation + 1, event):
            return None
        self.generation += 1
        for r in ranks:
            self.store.delete_key(ready_key(r))
        return event

    def _next_generation(self, error: BaseException) -> dict:
        """The membership the launcher publishes after a loss (the latest, when several followed)."""
        key = generation_key(self.generation + 1)
        try:
            if os.environ.get(CLAIM_ENV):
                self._claim_loss()
            self.store.wait([key], timedelta(seconds=self.cfg.train.join_timeout_s))
        except Exception:  # noqa: BLE001 -- no replica was lost: the error was the step's own
            raise error from None
        return self._advance()

    def _advance(self) -> dict:
        """Go to the latest generation published: each loss passed leaves its replica missing (and is logged at the
        agreement), each admission passed fills one."""
        latest, event = latest_generation(self.store, self.generation)
        for g in range(self.generation + 1, latest + 1):
            passed = event if g == latest else json.loads(self.store.get(generation_key(g)))
            if "joined" in passed:
                self.missing.pop(passed["joined_replica"], None)
            else:
                self.missing |= lost_by_replica(passed)
                self.losses.append((g, passed))
        self.generation = latest
        if self.rank not in event["ranks"]:
            raise RuntimeError(f"rank {self.rank} is not in generation {self.generation}'s membership")
        return event

    def _arrive(self, event: dict) -> dict:
        """Count this rank in ``event``'s generation and wait until every member has, so that the generation's
        group creation waits for no lost member; a later generation published meanwhile (a member was lost before
        it arrived) is gone on to instead. Returns the generation every member arrived at."""
        deadline = time.monotonic() + self.cfg.train.collective_timeout_s
        while True:
            _fresh_prefix(self.store, self.generation, len(event["ranks"]))
            counted = f"{generation_prefix(self.generation)}members"
            while self.store.add(counted, 0) < len(event["ranks"]):
                if self.store.check([generation_key(self.generation + 1)]):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"generation {self.generation}'s members did not all arrive within "
                                       f"[train].collective_timeout_s={self.cfg.train.collective_timeout_s:g} s")
                time.sleep(0.02)
            else:
                return event
            event = self._advance()

    def _claim_loss(self) -> None:
        """Where no launcher may publish the loss (:data:`CLAIM_ENV`): check in as a survivor of the current
        generation; once every member has (then nothing was lost: raises), or every member that has not is silent
        (its heartbeat still for :data:`SETTLE_S`: dead), claim the next generation for the replicas whose every rank
        checked in, unless a launcher or a peer published it (under pretrain's launchers, only where every lost rank is
        dead, :func:`claimable`: else the launcher fencing the live ones publishes). A member still beating is waited for (a survivor late
        to notice the loss), up to ``collective_timeout_s`` (then it is passed over, as one stuck in a collective)."""
        generation, current = self.generation + 1, self._members()
        self.store.set(alive_key(generation, self.rank), "1")
        watch = Silence(self.store, min(SETTLE_S, self.cfg.train.collective_timeout_s))
        deadline = time.monotonic() + self.cfg.train.collective_timeout_s
        while not self.store.check([generation_key(generation)]):
            absent = {r for r in current if not self.store.check([alive_key(generation, r)])}
            if not absent:
                raise RuntimeError("every member is alive: no replica was lost")
            dead = watch.silent(absent)
            if dead == absent or time.monotonic() > deadline:
                event = survivors_event(self.store, generation, current)
                if event is None:
                    raise RuntimeError("no replica is left whole")
                if claimable(event, dead, os.environ[CLAIM_ENV]):
                    claim(self.store, generation, event)
                return  # else a launcher fences the lost ranks still running, then publishes
            time.sleep(0.05)

    def _members(self) -> set[int]:
        """The ranks (generation 0's numbering) of this rank's generation."""
        if self.generation == 0:
            return set(range(self.layout.world_size))
        return set(json.loads(self.store.get(generation_key(self.generation)))["ranks"])

    def finished(self) -> None:
        """This rank's run is over: said in the store, where a replacement not admitted (torchrun's) reads it."""
        self.store.set(returned_key(self.rank), "1")

    def _config(self, replicas: int, microbatches: int = 1):
        return generation_config(self.cfg, self.layout.micro_batch, replicas, self.shard, microbatches)


class ReplicaLog:
    """What the step loop logs through: the real logger where this rank holds the log, else nothing. When the
    holder's replica is lost, the lowest surviving rank (the launcher's numbering) reopens it at the agreed step
    (lines of later steps, written by a lost rank, are dropped there, as on a resume)."""

    def __init__(self, logger, reopen, holder: int, rank: int) -> None:
        self.logger, self.reopen, self.holder, self.rank = logger, reopen, holder, rank

    def regrouped(self, event: dict, done: int) -> None:
        if self.holder in event.get("lost", ()):
            self.holder = min(event["ranks"])
            if self.holder == self.rank:
                self.logger = self.reopen(max(done, 1))  # 0 would set the run's log aside as an earlier run's

    def __getattr__(self, name: str):
        if self.logger is not None:
            return getattr(self.logger, name)
        return lambda *args, **kwargs: None


class StepRange:
    """The steps ``start .. stop - 1``; :meth:`attempt` wraps one step's work and, on a lost replica,
    regroups and sends the loop back to the agreed step boundary. While a replica is missing, its
    replacement is admitted at a boundary (:meth:`ReplicaRun.admit`)."""

    def __init__(self, run: ReplicaRun, start: int, stop: int, trainer) -> None:
        self.run, self.next, self.stop, self.trainer = run, start, stop, trainer

    def __iter__(self):
        while self.next < self.stop:
            step = self.next
            if self.run.missing and self.run.cfg.train.respawn:
                try:
                    self.run.admit(self.trainer, step)
                except Exception as e:
                    if not peer_lost(e):
                        raise
                    self.next = self.run.regroup(self.trainer, step, e)
                    continue
            self.next += 1
            yield step

    def attempt(self, step: int, trainer: ReplicaTrainer) -> "_Attempt":
        return _Attempt(self, step, trainer)


class _Attempt:
    """One step's guard (:meth:`StepRange.attempt`): a class, not a generator, so that the failed step's
    traceback, which holds the failed collective's frames and through them its process group, is let go
    before the regroup (a generator's ``__exit__`` keeps it in its frame until the regroup returns)."""

    def __init__(self, steps: StepRange, step: int, trainer) -> None:
        self.steps, self.step, self.trainer = steps, step, trainer

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if isinstance(error, PersistentRank):
            del tb
            self.steps.next = drop_replica(self.steps.run, self.trainer, self.step, error)
            return True
        if not isinstance(error, Exception) or not peer_lost(error):
            return False
        del tb
        self.steps.next = self.steps.run.regroup(self.trainer, self.step, error)
        return True


def generation_config(cfg, micro_batch: int, replicas: int, shard: int = 1, microbatches: int = 1):
    """The config a generation of ``replicas`` replicas is built from: the same model-parallel layout and
    micro-batch, and a batch any ``replicas`` divides (the trainer reads its :class:`ReplicaShare` of the run's
    batch, not the sampler's split, and trains under the run's config once built); ``microbatches``: this
    rank's share, what a pipeline schedule is built for. ``shard``: data ranks per replica (HSDP)."""
    t, p = cfg.train, cfg.parallel
    train = replace(t, global_batch=replicas * shard * microbatches * micro_batch, micro_batch=micro_batch, local_batch=0,
                    train_samples=0, fault_tolerance="off")  # one replica left is a valid generation
    hsdp = replicas if p.hsdp_replicas > 1 else 1  # HSDP: the replicas left, each the same sharding group
    return replace(cfg, train=train, parallel=replace(p, microbatches=0, rank_assignment="off", hsdp_replicas=hsdp))


def joining() -> bool:
    """Whether this process is a replacement the launcher started for a lost replica's rank."""
    return JOIN_ENV in os.environ


def join_distributed(cfg, device: str | None) -> tuple[int, int, int, torch.device]:
    """A replacement's :func:`~pretrain.runtime.launch.init_distributed`: say it waits, wait for the generation that
    admits it (at a step boundary), and join that generation's process group. Returns as init_distributed."""
    kind = device_type(device or cfg.train.device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(cpu_threads(os.environ))
    me, world0, store = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), _store(cfg)
    generation = int(os.environ[JOIN_ENV])
    store.set(ready_key(me), "1")
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # no launcher of ours to stop it: it stops itself
    while True:  # the launcher ends a replacement never admitted once every member has returned
        if not store.check([generation_key(generation + 1)]):
            if torchrun and _run_over(store, generation, world0):
                raise SystemExit(0)
            time.sleep(0.05)
            continue
        generation += 1
        event = json.loads(store.get(generation_key(generation)))
        if me in event.get("joined", ()):
            break
    alive, first = sorted(set(event["replicas"].values())), cfg.validate_world(world0)
    shard, coords = _shard_size(cfg, first.dp), json.loads(store.get(coords_key(me)))
    layout = generation_config(cfg, first.micro_batch, len(alive), shard).validate_world(len(event["ranks"]))
    rank = _position(layout.grid, coords, _data_index(alive, event["replicas"][str(me)], coords, shard))
    _fresh_prefix(store, generation, len(event["ranks"]))
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", store=dist.PrefixStore(generation_prefix(generation), store),
                            rank=rank, world_size=len(event["ranks"]),
                            timeout=timedelta(seconds=cfg.train.collective_timeout_s))
    os.environ.update({ORIGINAL_RANK: str(me), ORIGINAL_WORLD: str(world0), "RANK": str(rank),
                       "WORLD_SIZE": str(len(event["ranks"])), ADMITTED: json.dumps(event | {"generation": generation})})
    return rank, len(event["ranks"]), local_rank, torch.device(f"cuda:{local_rank}") if kind == "cuda" else torch.device("cpu")


def _run_over(store, generation: int, world: int) -> bool:
    """Whether every member of the latest generation from ``generation`` on has returned (:meth:`ReplicaRun.finished`)."""
    _, event = latest_generation(store, generation)
    return store.check([returned_key(r) for r in (event["ranks"] if event else range(world))])


def freeze_imports(cfg) -> None:
    """Under fault tolerance, before the run makes anything (its groups first): what this rank process imported
    (torch and the trainer: most of its objects) is left out of every later collection, so a regroup's
    (:func:`_leave_groups`), which every survivor stands still for, walks only what the run made: what it must
    free (each generation's groups and trainers, a failed step's frames), which it still does."""
    if cfg.train.fault_tolerance == "replica":
        gc.freeze()


def replica_run(cfg, stops, device: torch.device) -> ReplicaRun | None:
    return ReplicaRun(cfg, stops, device) if cfg.train.fault_tolerance == "replica" else None


def attempt(steps, step: int, trainer):
    """The step's guard: :meth:`StepRange.attempt` under fault tolerance, else nothing."""
    return steps.attempt(step, trainer) if isinstance(steps, StepRange) else nullcontext()


def _leave_groups(error: BaseException | None, *holders) -> None:
    """Destroy every process group: closes this rank's connections, so a survivor still waiting on it
    in a collective of the old generation fails at once instead of at its timeout. A group's connections
    close only once nothing holds it: ``error`` lets go of its traceback (whose frames hold the failed
    collective's group), and ``holders`` (objects with a ``group``: the stop requests) of theirs; else a
    survivor in that group's collective would wait for a peer gone on to the next generation's rendezvous,
    where the peer waits for it."""
    seen = set()
    while error is not None and id(error) not in seen:  # the frames go, their text stays for a re-raise
        seen.add(id(error))
        if error.__traceback__ is not None:
            error.add_note("".join(traceback.format_tb(error.__traceback__)).rstrip())
            error.__traceback__ = None
        error = error.__cause__ or error.__context__
    for holder in holders:
        holder.group = None
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- a group broken by the loss may not tear down cleanly; it is gone either way
        pass
    gc.collect()  # a group held in a reference cycle goes now, not at the next collection


def _discard_save(cfg, step: int) -> None:
    """A save of ``step`` a loss interrupted was never published (no ``step_<step>``, no ``latest`` to it): its
    temporary directory goes, as the store's next save of that step would remove it."""
    tmp = checkpoint_root(cfg) / f"step_{step}.tmp"
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)


def _store(cfg):
    """A client of the launcher's store (it outlives every rank)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timedelta(seconds=cfg.train.join_timeout_s))


def _fresh_prefix(store, generation: int, world: int) -> None:
    """Count this rank in ``generation``'s store prefix; a count past its ``world`` members means the prefix was
    used before, where a rank could read an earlier generation's address or barrier count and hang or mix."""
    prefix = generation_prefix(generation)
    count = store.add(f"{prefix}members", 1)
    if count > world:
        raise RuntimeError(f"store prefix {prefix!r} of generation {generation} was used before ({count} members "
                           f"counted for {world})")


def _same_block(a: dict, b: dict, shard: int = 1) -> bool:
    """Whether ``a`` and ``b`` hold the same state: the same model-parallel coordinates and HSDP shard."""
    return all(a[k] == b[k] for k in MODEL_PARALLEL) and a["dp"] % shard == b["dp"] % shard


def _block(coords: dict, shard: int) -> dict:
    """The state ``coords`` holds, the same in every generation: its model-parallel coordinates and HSDP shard."""
    return {k: coords[k] for k in MODEL_PARALLEL} | {"shard": coords["dp"] % shard}


def _shard_size(cfg, dp: int) -> int:
    """The data ranks of one replica, lost and regrouped together (config/fault_rules.py)."""
    return replica_data_ranks(cfg.parallel, dp)


def _data_index(alive: list[int], replica: int, coords: dict, shard: int) -> int:
    """A rank's data-parallel index among the ``alive`` replicas: its replica's place, then its shard in it."""
    return alive.index(replica) * shard + coords["dp"] % shard


def _position(grid, coords: dict, dp: int) -> int:
    """The rank of ``grid`` at this rank's model-parallel coordinates and data-parallel index ``dp``."""
    want = {k: coords[k] for k in MODEL_PARALLEL} | {"dp": dp}
    for r in range(grid.world_size):
        c = grid.coords(r)
        if all(c[k] == v for k, v in want.items()):
            return r
    raise RuntimeError(f"no rank at {want} in the regrouped grid")
