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
smaller world, copies its own state into it (weights, fp32 masters, optimizer state and step; this
process's RNG is untouched), and the step loop goes on from the step boundary every survivor agrees
on: the interrupted step is discarded and redone.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from par_groups import comm

from ..checkpoint.rng_state import rng_state, set_rng_state
from ..data.sampler import Batch
from ..errors import UsageError
from ..model.dropout import set_position as set_dropout_position
from ..runtime.rank_env import LAUNCHER_ENV
from ..runtime.replica_membership import generation_key, generation_prefix, replica_key
from .micro_batches import NO_DOCUMENTS
from .train_loop import Trainer

# What a surviving rank reads when a peer died under a collective (gloo; NCCL: an error or the timeout)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
             "timed out", "Timeout", "NCCL communicator was aborted", "DistBackendError")


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

    def __init__(self, cfg, share: ReplicaShare, sample_log: Path | None = None, **kwargs) -> None:
        self.share, self.sample_log = share, sample_log
        self.completed: int | None = None  # steps done (set after each step: a failure after it keeps it)
        self.generation = 0
        super().__init__(cfg, **kwargs)

    def _read_batch(self, step: int, eval: bool | str = False) -> Batch:
        s, share = self.sampler, self.share
        stream = (s.test if eval == "test" else s.valid) if eval else s.train
        ids = share.samples(step)
        batch = stream.gather(ids.start, ids.stop)
        shape = (share.count, share.micro_batch, s.seq_len + 1)
        return Batch(batch.tokens.reshape(shape), batch.segments.reshape(shape))

    def loss(self, out, labels, batch=NO_DOCUMENTS):
        loss = super().loss(out, labels, batch)
        return loss if self.share.weight == 1.0 else loss * self.share.weight

    def forward_chunk(self, batch, chunk_id, module, x, microbatch):
        m = self.cfg.model
        if m.hidden_dropout > 0 or m.attention_dropout > 0:  # the masks of the global samples this micro-batch holds
            first = self.share.samples(self._step).start + microbatch * self.share.micro_batch
            set_dropout_position(self.cfg.train.seed, self._step, first)
        with self.fp8_region():
            return module(x, docs=batch.docs[microbatch]) if batch.docs else module(x)

    def train_step(self, step: int):
        result = super().train_step(step)
        self.completed = step + 1
        if self.sample_log is not None:
            with open(self.sample_log, "a") as f:
                f.write(json.dumps({"step": step + 1, "generation": self.generation,
                                    "samples": list(self.share.samples(step))}) + "\n")
        return result


def owned_state(trainer) -> dict[str, list[torch.Tensor]]:
    """Every piece of state this rank owns, by name: trained tensors' fp32 masters and optimizer state
    (this rank's boxes, views of its buffers), the other parameters and buffers whole. Ranks at one
    model-parallel coordinate of any two replicas own the same names and shapes."""
    dp = trainer.model.dp
    kinds = ("master",) + tuple(dp.optimizer_state.state_kinds())
    owned = {kind: dp.owned_pieces(kind) for kind in kinds}
    out = {}
    for name, t in trainer.model.full_named_tensors().items():
        if t not in owned["master"]:
            out[f"model/{name}"] = [t]
            continue
        for kind in kinds:
            out[f"{kind}/{name}"] = [box for _, box in owned[kind][t].boxes]
    return out


@torch.no_grad()
def copy_state(src, dst) -> None:
    """``dst`` (a fresh trainer of the same model-parallel layout) takes ``src``'s state, in this process."""
    kinds = src.model.dp.optimizer_state.state_kinds()
    dst.model.dp.optimizer_state.prepare_load(kinds)
    a, b = owned_state(src), owned_state(dst)
    if a.keys() != b.keys():
        raise RuntimeError(f"regrouped trainer holds other state: {sorted(a.keys() ^ b.keys())[:4]}")
    for name, boxes in a.items():
        for x, y in zip(boxes, b[name], strict=True):
            y.copy_(x)
    dst.model.dp.sync_params()
    dst.model.dp.step_count = src.model.dp.step_count
    dst.model.dp.optimizer_state.finish_load(src.model.dp.optimizer_state.scalar_state())
    dst.non_finite, dst.completed = src.non_finite, src.completed


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is what a collective raises when a peer is gone."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = f"{type(error).__name__}: {error}"
        if any(marker in text for marker in PEER_LOST):
            return True
        error = error.__cause__ or error.__context__
    return False


class ReplicaRun:
    """This rank's membership across generations; makes the trainers and regroups them after a loss."""

    def __init__(self, cfg, stops, device: torch.device) -> None:
        if LAUNCHER_ENV not in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
            raise UsageError("[train].fault_tolerance='replica' runs under pretrain's own launcher "
                             "(`pretrain train --nproc N`), not torchrun; set it to 'off' there")
        self.cfg, self.stops, self.device = cfg, stops, device
        self.rank = dist.get_rank()  # generation 0's numbering: the launcher's
        self.generation = 0
        self.layout = cfg.validate_world(dist.get_world_size())
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                                   timedelta(seconds=cfg.train.join_timeout_s))
        self.kwargs: dict = {}
        self.replica = -1
        self.logger = None

    def trainer(self, cfg, **kwargs) -> ReplicaTrainer:
        """Generation 0's trainer (every replica alive); publishes this rank's replica for the launcher."""
        self.kwargs = kwargs
        layout = self.layout
        share = ReplicaShare(cfg.train.global_batch, layout.micro_batch, layout.dp, 0)
        trainer = ReplicaTrainer(cfg, share, **kwargs)
        self.replica = trainer.groups.coords()["dp"]
        trainer.share = replace(share, index=self.replica)
        trainer.sample_log = self._sample_log(trainer)
        self.store.set(replica_key(self.rank), str(self.replica))
        return trainer

    def _sample_log(self, trainer) -> Path | None:
        c = trainer.groups.coords()
        if not self.cfg.log.sample_ids or c["tp"] or c["cp"] or c["pp"]:  # one rank per replica writes
            return None
        folder = Path(self.cfg.log.dir) / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"rank_{self.rank}.jsonl"

    def steps(self, start: int, stop: int, logger=None) -> "StepRange":
        self.logger = logger
        return StepRange(self, start, stop)

    # ---- regrouping ------------------------------------------------------------------------
    def regroup(self, trainer: ReplicaTrainer, step: int, error: BaseException) -> int:
        """After ``error`` in step ``step``: the next generation's groups and trainer (adopted in place by
        ``trainer``); returns the step every survivor goes on from."""
        began = time.monotonic()
        done = trainer.completed if trainer.completed == step + 1 else step
        _leave_groups()
        event = self._next_generation(error)
        alive = sorted(set(event["replicas"].values()))
        world = len(event["ranks"])
        cfg = self._config(len(alive))
        layout = cfg.validate_world(world)
        rank = _position(layout.grid, trainer.groups.coords(), alive.index(self.replica))
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                store=dist.PrefixStore(generation_prefix(self.generation), self.store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=cfg.train.collective_timeout_s))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        share = ReplicaShare(trainer.share.global_batch, trainer.share.micro_batch, len(alive), alive.index(self.replica))
        rng = rng_state()  # a fresh trainer seeds torch: this process's stream goes on as it was
        fresh = ReplicaTrainer(cfg, share, trainer.sample_log, **self.kwargs)
        set_rng_state(rng)
        fresh.cfg, fresh.generation = self.cfg, self.generation  # the run's config: its schedule, its checkpoints
        copy_state(trainer, fresh)
        if trainer.prefetch is not None:
            trainer.prefetch.close()
        trainer.__dict__ = fresh.__dict__  # every holder of the trainer (the loop, the saver) sees the new one
        self.stops.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=min(cfg.train.collective_timeout_s, 30.0)))
        agreed = torch.tensor([done, -done], dtype=torch.int64)
        comm.all_reduce(agreed, None, op=dist.ReduceOp.MAX)
        if int(agreed[0]) != -int(agreed[1]):
            raise RuntimeError(f"survivors stopped at different steps ({-int(agreed[1])} and {int(agreed[0])}) "
                               f"after replica {event['lost_replica']} was lost")
        if self.logger is not None:
            self.logger.log_event("replica_lost", step=done, ranks=event["lost"], replica=event["lost_replica"],
                                  generation=self.generation, replicas_left=len(alive),
                                  stood_still_s=round(time.monotonic() - began, 3))
        return done

    def _next_generation(self, error: BaseException) -> dict:
        """The membership the launcher publishes after a loss (the latest, when several followed)."""
        key = generation_key(self.generation + 1)
        try:
            self.store.wait([key], timedelta(seconds=self.cfg.train.join_timeout_s))
        except Exception:  # noqa: BLE001 -- no replica was lost: the error was the step's own
            raise error from None
        self.generation += 1
        while self.store.check([generation_key(self.generation + 1)]):
            self.generation += 1
        event = json.loads(self.store.get(generation_key(self.generation)))
        if self.rank not in event["ranks"]:
            raise RuntimeError(f"rank {self.rank} is not in generation {self.generation}'s membership")
        event["replicas"] = {int(r): v for r, v in event["replicas"].items()}
        return event

    def _config(self, replicas: int):
        """The config a generation of ``replicas`` replicas is built from: the same model-parallel layout and
        micro-batch, and a batch any ``replicas`` divides (the trainer reads its :class:`ReplicaShare` of the run's
        batch, not the sampler's split, and trains under the run's config once built)."""
        t, p = self.cfg.train, self.cfg.parallel
        train = replace(t, global_batch=replicas * self.layout.micro_batch, micro_batch=self.layout.micro_batch,
                        local_batch=0, train_samples=0)
        return replace(self.cfg, train=train, parallel=replace(p, microbatches=0, rank_assignment="off"))


class StepRange:
    """The steps ``start .. stop - 1``; :meth:`attempt` wraps one step's work and, on a lost replica,
    regroups and sends the loop back to the agreed step boundary."""

    def __init__(self, run: ReplicaRun, start: int, stop: int) -> None:
        self.run, self.next, self.stop = run, start, stop

    def __iter__(self):
        while self.next < self.stop:
            step = self.next
            self.next += 1
            yield step

    @contextmanager
    def attempt(self, step: int, trainer: ReplicaTrainer):
        try:
            yield
        except Exception as e:
            if not peer_lost(e):
                raise
            self.next = self.run.regroup(trainer, step, e)


def replica_run(cfg, stops, device: torch.device) -> ReplicaRun | None:
    return ReplicaRun(cfg, stops, device) if cfg.train.fault_tolerance == "replica" else None


def attempt(steps, step: int, trainer):
    """The step's guard: :meth:`StepRange.attempt` under fault tolerance, else nothing."""
    return steps.attempt(step, trainer) if isinstance(steps, StepRange) else nullcontext()


def _leave_groups() -> None:
    """Destroy every process group: closes this rank's connections, so a survivor still waiting on it
    in a collective fails at once instead of at its timeout."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- a group broken by the loss may not tear down cleanly; it is gone either way
        pass


def _position(grid, coords: dict, dp: int) -> int:
    """The rank of ``grid`` at this rank's model-parallel coordinates and data-parallel index ``dp``."""
    want = {"tp": coords["tp"], "cp": coords["cp"], "pp": coords["pp"], "dp": dp}
    for r in range(grid.world_size):
        c = grid.coords(r)
        if all(c[k] == v for k, v in want.items()):
            return r
    raise RuntimeError(f"no rank at {want} in the regrouped grid")
