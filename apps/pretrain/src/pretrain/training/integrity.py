"""Silent data corruption: the copies that must be bitwise equal are compared, and a suspect rank's
micro-batch is recomputed in the job to tell a wrong GPU from a wrong batch.

Two checks, at log steps only (``Trainer.check_finite``, before any checkpoint is written):

- **Copies** (every ``[log].integrity_every`` log steps): every rank hashes each piece of state it owns
  (the fp32 masters and every optimizer state kind, box by box, and the model's own tensors), keyed by
  name, kind and box; pieces with the same key on several ranks (dp replicas, TP copies of replicated
  parameters, HSDP replicas) must hash alike. The hashes are gathered within the pipeline stage (the
  tp x dp x cp ranks that hold every copy of its pieces): stages are never compared, and the gather
  is 1/pp of the world. With three or more copies the odd ones are named; with two,
  the difference is logged (``copies_differ``) and the loss check below tells which rank is wrong.
- **Loss** (every log step): each rank keeps, on the device, its worst micro-batch loss since the last
  log step (non-finite is worst) with its step and micro-batch. A rank whose worst is non-finite, or
  above its peers' median by half of it and five MADs, is the suspect; so is a rank whose own reduced
  gradient was not finite (``local_sq``, left by par_zero's clipping) while the same piece's in another
  replica was (a bad batch reaches every replica through the reduction), with its step's first
  micro-batch (the replicas dropped or kept that step alike: the norms' finiteness is summed with the
  loss). Then every replica recomputes
  the suspect's micro-batch (the data is a function of the step and the dp rank; the weights are the
  ones the copies check found equal) and each rank compares with the ranks at its model-parallel
  coordinate in the other replicas: **persistent** if the suspect's rerun differs from its peers'
  (it computes wrong), **correct** if every rerun agrees and is itself anomalous (the data or the
  model), **transient** if every rerun agrees and is normal (its first result was a glitch). The
  check runs before the log step's update is applied (:meth:`Integrity.losses`, from
  ``Trainer.train_step``): a suspect of the log step itself is rerun with its own step's weights, one
  of an earlier step with the current weights. A persistent suspect's loss is
  shared by the tp and cp ranks of its replica, and fed by its other pipeline stages: the one named
  is the rank whose rerun's module outputs (hashed, by chunk in order) first differ from its
  coordinate's in the other replicas. A transient or correct one is the rank of its replica whose
  rerun first differs from its own first run (fingerprints.py: each rank's module outputs, kept on the
  device during the step; a fault seen first there, before a collective spread it); where none
  differs or none was kept (an update applied since: a spike before the log step), the loss names
  it (within its replica's tp and cp ranks at the loss's stage, the first).

A persistent rank or an odd copy stops the run with one line naming the rank, its host and its GPU.
Under ``fault_tolerance = "replica"`` its replica is dropped instead (replica_drop.py), before the step's
update: there the copies are compared before it too (with the loss check, ahead of its rerun), so the
survivors, whose copies agree, redo the step without the odd one's contribution. Ranks are named in the
launcher's numbering (``PRETRAIN_FT_RANK``: a regroup renumbers the survivors), as the console and the
``replica_lost`` events name them; ``generation_rank`` is the current one.
Transient and correct verdicts are logged (``"event": "corruption"``) and the run goes on.
Cost per copies check: one hash pass over the owned state on the device, one host read of the
hashes and one all-gather of them (``hash_bytes``, ``hash_s`` in the event ``integrity_check``).
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from par_groups import comm
from par_groups.param_placement import placement_of

from ..errors import UsageError
from ..observe.inject import RANK_ENV
from .fingerprints import RERUN, Fingerprints, earliest, first_change

SPIKE_RELATIVE, SPIKE_MADS = 0.5, 5.0
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bits (plain and position-weighted, wrapping): any flipped bit changes them."""
    flat = t.detach().contiguous().view(-1)
    ints = flat.view(_INT[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, 2 * ints.numel(), 2, dtype=torch.int64, device=ints.device)
    return torch.stack([ints.sum(), (ints * weights).sum()])


def owned_pieces(trainer) -> dict[str, torch.Tensor]:
    """Every piece of state this rank owns, keyed ``kind/name@offsets``: masters and optimizer state
    box by box, the model's other tensors whole."""
    dp = trainer.model.dp
    named = trainer.model.full_named_tensors()
    names = {id(t): n for n, t in named.items()}
    out = {}
    for kind in ("master",) + tuple(dp.optimizer_state.state_kinds()):
        for param, pieces in dp.owned_pieces(kind).items():
            for offsets, box in pieces.boxes:
                out[f"{kind}/{names.get(id(param), '?')}@{tuple(offsets)}"] = box
    for name, t in named.items():
        if t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size():
            continue  # a sharded parameter between steps (ZeRO-3: its storage freed): its masters are hashed
        out[f"model/{name}@{tuple(placement_of(t).offsets)}"] = t
    return out


def odd_copies(hashes: list[dict]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """``hashes[rank] = {key: hash}``: (keys whose minority copies are named by a majority of 3 or more,
    keys whose copies disagree with no majority), each with the ranks concerned."""
    holders: dict[str, dict] = {}
    for rank, mine in enumerate(hashes):
        for key, h in mine.items():
            holders.setdefault(key, {})[rank] = tuple(h)
    odd, split = {}, {}
    for key, by_rank in holders.items():
        values = list(by_rank.values())
        if len(by_rank) < 2 or len(set(values)) == 1:
            continue
        top = max(set(values), key=values.count)
        if values.count(top) * 2 > len(values):
            odd[key] = sorted(r for r, h in by_rank.items() if h != top)
        else:
            split[key] = sorted(by_rank)
    return odd, split


def spike(value: float, peers: list[float]) -> bool:
    """Non-finite, or above the peers' median by half of it and by ``SPIKE_MADS`` MADs."""
    if value != value or value in (float("inf"), float("-inf")):
        return True
    finite = [v for v in peers if v == v and abs(v) != float("inf")]
    if not finite:
        return False
    base = statistics.median(finite)
    mad = 1.4826 * statistics.median([abs(v - base) for v in finite])
    return value - base > max(SPIKE_RELATIVE * abs(base), SPIKE_MADS * mad)


class PersistentRank(UsageError):
    """A rank computes wrong results persistently (or holds an odd copy): the run's one-line stop, or, where the
    trainer drops replicas (``[train].fault_tolerance = "replica"``), the verdict its replica leaves the run on."""

    def __init__(self, line: str, rank: int, dp: int, event: dict) -> None:
        super().__init__(line)
        self.rank, self.dp, self.event = rank, dp, event  # the rank (this generation's), its data-parallel index


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


class Integrity:
    """One rank's side of both checks (every rank calls :meth:`note` per step, :meth:`check` at log steps)."""

    def __init__(self, trainer, off: bool = False) -> None:
        self.every = 0 if off else trainer.cfg.log.integrity_every
        self.events: list[dict] = []  # for rank 0's log (:meth:`take`)
        self.checked_at = self.losses_at = -1
        self.found: tuple = (None, -1, -1, -1)  # the loss check's verdict, suspect, its step and micro-batch
        self.device = trainer.device
        # worst micro-batch loss's score, loss, step, micro-batch; the first step whose own gradient was not finite
        self.worst = torch.tensor([-float("inf"), 0.0, -1.0, -1.0, -1.0], dtype=torch.float64, device=self.device)
        self.checks = 0
        self.ranks: list[tuple] | None = None  # every rank's (dp, model coordinate, host, gpu, launcher's rank)
        self.copied: tuple = (-1, {}, {})  # the copies check's step, odd and split keys (once per step)
        self.trace: list = []  # the last rerun's module output hashes
        m = trainer.cfg.model  # a training forward and its rerun compute alike only without dropout
        self.prints = Fingerprints(trainer.model.chunks, bool(self.every) and not (m.hidden_dropout or m.attention_dropout))
        self.rerunning = False

    def note(self, step: int, losses: list[torch.Tensor], grad_sq: torch.Tensor | None = None, weight: float = 1.0) -> None:
        """This step's micro-batch losses (each scaled by ``weight``: compared unscaled) and the squared sum of
        this rank's own reduced gradient (on the device; nothing read)."""
        if not self.every:
            return
        if grad_sq is not None:
            bad = (self.worst[4] < 0) & ~torch.isfinite(grad_sq)
            self.worst[4:].copy_(torch.where(bad, torch.full_like(self.worst[4:], step), self.worst[4:]))
        if not losses:
            return
        loss = torch.stack([x.detach().double().reshape(()) for x in losses]) / weight
        score = torch.where(torch.isfinite(loss), loss, torch.full_like(loss, float("inf")))
        m = score.argmax().reshape(1)  # gathered by index on the device: no host read
        top = score.gather(0, m)
        row = torch.cat([top, loss.gather(0, m), torch.full_like(top, step), m.double()])
        self.worst[:4].copy_(torch.where(row[0] > self.worst[0], row, self.worst[:4]))

    def _who(self, trainer) -> list[tuple]:
        if self.ranks is None or len(self.ranks) != dist.get_world_size():  # once, and again after a regroup
            coords = trainer.groups.coords()
            model = (coords["tp"], coords["cp"], coords["pp"])  # the same work in every replica
            gpu = str(self.device.index if self.device.index is not None else torch.cuda.current_device()) \
                if self.device.type == "cuda" else self.device.type
            every: list = [None] * dist.get_world_size()
            launched = int(os.environ.get(RANK_ENV, dist.get_rank()))
            comm.all_gather_object(every, (coords["dp"], model, socket.gethostname(), gpu, launched), None)
            self.ranks = every
        return self.ranks

    def name(self, rank: int) -> str:
        _, _, host, gpu, launched = self.ranks[rank]
        return f"rank {launched} (host {host}, GPU {gpu})"

    def named(self, rank: int) -> dict:
        """The event's keys naming ``rank`` (this generation's): the launcher's number, its host and GPU."""
        _, _, host, gpu, launched = self.ranks[rank]
        return {"rank": launched, "generation_rank": rank, "host": host, "gpu": gpu}

    def take(self) -> dict:
        """The events since the last take, for the log line (``MetricsLogger.log`` writes them)."""
        out, self.events = self.events, []
        return {"integrity": out} if out else {}

    def check(self, trainer, step: int) -> list[str]:
        """Both checks at log step ``step`` (every rank): the verdicts in words (the events are kept for
        the log); raises the one-line stop."""
        if not self.every or step == self.checked_at:
            return []
        self.checked_at = step
        odd, split = self.compare_copies(trainer, step)
        self.losses(trainer, step)  # a no-op where the step ran it before its update
        verdict, suspect, at, micro = self.found
        self.found = (None, -1, -1, -1)
        if odd:
            ranks = sorted({r for rs in odd.values() for r in rs})
            key = next(iter(odd))
            raise UsageError(f"silent corruption: {', '.join(self.name(r) for r in ranks)} holds a copy of {key} "
                             f"(and {len(odd) - 1} more) unlike its replicas'; stopping")
        if verdict == "persistent":
            raise UsageError(self.persistent_line(suspect, at, micro))
        if split and dist.get_rank() == 0:  # two copies and no suspect yet: which one is wrong is not known
            self.events.append({"event": "copies_differ", "step": step, "key": next(iter(split)), "keys": len(split),
                                "ranks": sorted({self.ranks[r][4] for rs in split.values() for r in rs})})
        return [f"{verdict} on {self.name(suspect)}"] if verdict else []

    def persistent_line(self, suspect: int, at: int, micro: int) -> str:
        return (f"silent corruption: {self.name(suspect)} computes wrong results persistently (its rerun of step "
                f"{at + 1}'s micro-batch {micro} differs from its replicas'); stopping")

    def losses(self, trainer, step: int) -> None:
        """The loss check at log step ``step`` (every rank), once: the step runs it before its update where
        it applies one (``Trainer.train_step``), so that the fingerprints of its own forward, taken with the
        weights the rerun uses, can name the rank where a finite fault entered; else :meth:`check` runs it
        after the step (a skipped update changed no weight). The verdict waits in ``found`` for :meth:`check`."""
        if not self.every or step == self.losses_at:
            return
        self.losses_at = step
        who = self._who(trainer)
        if trainer.drops_replicas:  # an odd copy's replica leaves before this step's update, as a persistent rank's
            self.drop_odd(step, self.compare_copies(trainer, step)[0])
        row = self.worst.clone()
        self.worst.fill_(-float("inf"))
        every = torch.empty(len(who) * len(row), dtype=torch.float64, device=self.device)
        comm.all_gather_into_tensor(every, row, None)
        rows = every.view(len(who), -1).tolist()
        held = [r for r, x in enumerate(rows) if x[2] >= 0]  # ranks that hold a loss (the last stage)
        suspects = [r for r in held if spike(rows[r][1], [rows[o][1] for o in held if o != r])]
        # its own reduced gradient not finite while the same piece in another replica is: a bad batch would
        # have reached every replica through the reduction
        grads = [r for r, x in enumerate(rows) if x[4] >= 0 and any(
            rows[o][4] < 0 for o, w in enumerate(who) if w[1] == who[r][1] and w[0] != who[r][0])]
        trigger = "loss" if suspects else "gradient"
        if suspects or grads:
            suspect = max(suspects, key=lambda r: rows[r][0]) if suspects else grads[0]
            at, micro = (int(rows[suspect][2]), int(rows[suspect][3])) if suspects else (int(rows[suspect][4]), 0)
            verdict = self._rerun(trainer, suspect, at, micro, [rows[o][1] for o in held if o != suspect])
            if verdict == "persistent":  # the loss is shared by its replica's tp and cp ranks: which computed wrong
                suspect, named_by = self.first_to_differ(suspect), "rerun_vs_replicas"
            else:  # which of them computed something else the first time
                suspect, named_by = self.first_to_change(suspect, at, micro)
            self.found = (verdict, suspect, at, micro)
            event = {"event": "corruption", "step": step, "class": verdict, **self.named(suspect), "named_by": named_by,
                     "trigger": trigger, "suspect_step": at + 1,
                     "micro_batch": micro, "suspect_loss": _finite(rows[suspect][1]) if suspects else None}
            if verdict == "persistent" and trainer.drops_replicas:  # its replica leaves; this update is not applied
                self.prints.updated()
                raise PersistentRank(self.persistent_line(suspect, at, micro), suspect, who[suspect][0], event)
            if dist.get_rank() == 0:
                self.events.append(event)
        self.prints.updated()  # compared: the next check compares the steps after this one

    def compare_copies(self, trainer, step: int) -> tuple[dict, dict]:
        """The copies check at log step ``step`` where it is due (every ``integrity_every`` log steps), once
        per step: (odd keys, split keys), each with the ranks concerned (this generation's numbering)."""
        if self.copied[0] != step:
            self.checks += 1
            odd, split = {}, {}
            if self.checks % self.every == 0:
                self._who(trainer)
                odd, split, cost = self._copies(trainer)
                if dist.get_rank() == 0:
                    self.events.append({"event": "integrity_check", "step": step, **cost, **self.prints.take_cost(),
                                        "odd": len(odd), "split": len(split)})
            self.copied = (step, odd, split)
        return self.copied[1], self.copied[2]

    def drop_odd(self, step: int, odd: dict) -> None:
        """Raises the verdict that drops the replica holding the odd copies (every rank), where one does."""
        ranks = sorted({r for rs in odd.values() for r in rs})
        if not ranks or len({self.ranks[r][0] for r in ranks}) > 1:  # none, or in several replicas: the stop
            return
        key = next(iter(odd))
        line = (f"silent corruption: {', '.join(self.name(r) for r in ranks)} holds a copy of {key} "
                f"(and {len(odd) - 1} more) unlike its replicas'")
        event = {"event": "corruption", "step": step, "class": "odd_copy", **self.named(ranks[0]), "named_by": "copies",
                 "key": key, "keys": len(odd), "ranks": [self.ranks[r][4] for r in ranks]}
        self.prints.updated()
        raise PersistentRank(line, ranks[0], self.ranks[ranks[0]][0], event)

    def _copies(self, trainer) -> tuple[dict, dict, dict]:
        start = time.perf_counter()
        pieces = owned_pieces(trainer)
        hashes = torch.stack([tensor_hash(t) for t in pieces.values()]).tolist() if pieces else []
        mine = dict(zip(pieces, hashes))
        g = trainer.groups  # the ranks of this pipeline stage: every copy of a piece it holds, no other stage's
        members = list(g.ranks["tp_dp_cp"])
        every: list = [None] * len(members)
        comm.all_gather_object(every, mine, g.tp_dp_cp)
        odd, split = (({key: [members[i] for i in at] for key, at in found.items()}) for found in odd_copies(every))
        hashed = sum(t.numel() * t.element_size() for t in pieces.values())
        return odd, split, {"hash_s": round(time.perf_counter() - start, 6), "hashed_bytes": hashed,
                            "hash_bytes": len(repr(mine).encode()), "gather_ranks": len(members)}

    def _rerun(self, trainer, suspect: int, step: int, microbatch: int, peers_first: list[float]) -> str:
        """Every replica recomputes the suspect's micro-batch; the verdict (the same on every rank)."""
        dp, model = self.ranks[suspect][:2]
        batch = trainer.rerun_batch(dp, step)
        one = type(batch)(batch.tokens[microbatch:microbatch + 1], batch.segments[microbatch:microbatch + 1])
        was = trainer.model.module.training
        trainer.model.module.eval()
        trace: list[tuple[int, torch.Tensor]] = []  # each module's output hashed with its chunk, as they finish

        def record(chunk: int):
            def hook(module, inputs, output):
                t = output[0] if isinstance(output, (tuple, list)) else output
                if torch.is_tensor(t) and t.is_floating_point():
                    trace.append((chunk, tensor_hash(t)))
            return hook

        hooks = [m.register_forward_hook(record(c)) for c, chunk in trainer.model.chunks.items() for m in chunk.modules()]
        self.rerunning = True  # its fingerprints kept apart from the first run's
        try:
            with torch.no_grad(), trainer._compute_context():
                losses = trainer.runner.eval_losses(trainer.microbatches(one))
        finally:
            self.rerunning = False
            for h in hooks:
                h.remove()
            trainer.model.module.train(was)
        hashes = torch.stack([h for _, h in trace]).tolist() if trace else []
        self.trace = [(c, tuple(h)) for (c, _), h in zip(trace, hashes)]
        mine = torch.tensor([float("nan") if not losses else 0.0, 0.0], dtype=torch.float64, device=self.device)
        if losses:
            mine[1] = losses[0].detach().double() / trainer.loss_weight
            mine[0] = 1.0
        every = torch.empty(len(self.ranks) * 2, dtype=torch.float64, device=self.device)
        comm.all_gather_into_tensor(every, mine, None)
        reruns = every.view(-1, 2).tolist()
        peers = [r for r, w in enumerate(self.ranks) if w[1] == model and r != suspect and reruns[r][0] == 1.0]
        theirs = [reruns[r][1] for r in peers]
        own = reruns[suspect][1]
        same = lambda a, b: a == b or (a != a and b != b)  # noqa: E731 - NaN reproduces NaN
        if theirs and not any(same(own, v) for v in theirs):
            return "persistent"
        return "correct" if spike(own, peers_first) else "transient"

    def first_to_change(self, suspect: int, step: int, microbatch: int) -> tuple[int, str]:
        """Of the suspect's replica's ranks, the one whose rerun first differs from its own first run of the
        micro-batch (fingerprints.py), and how it was named: by ``"fingerprints"``, or by ``"loss"`` (the
        suspect) where no rank kept its first run's (an update applied since) or none changed. Every rank calls it."""
        first, rerun = self.prints.of(step, microbatch), self.prints.of(RERUN, 0)
        self.prints.kept = {k: v for k, v in self.prints.kept.items() if k[0] != RERUN}
        mine = first_change(first, rerun or []) if first is not None else None
        every: list = [None] * dist.get_world_size()
        comm.all_gather_object(every, mine, None)
        dp = self.ranks[suspect][0]
        changes = {r: every[r] for r, w in enumerate(self.ranks) if w[0] == dp}
        named = earliest(changes, suspect)
        return named, "fingerprints" if any(c is not None for c in changes.values()) else "loss"

    def first_to_differ(self, suspect: int) -> int:
        """Of the ranks of the suspect's replica (its loss is shared by its tp and cp ranks, and its pipeline
        stages feed it), the one whose rerun's module outputs differ first from those at its coordinate
        in the other replicas: where a wrong result entered. "First" is by chunk (a micro-batch's forward
        runs the chunks in order, whichever stage holds them), then by module within the chunk. Every
        rank calls it (it gathers the traces)."""
        every: list = [None] * dist.get_world_size()
        comm.all_gather_object(every, self.trace, None)
        dp = self.ranks[suspect][0]

        def first(r: int) -> tuple:
            peers = [every[o] for o, w in enumerate(self.ranks) if w[1] == self.ranks[r][1] and w[0] != dp]
            within: dict[int, int] = {}
            for i, (chunk, h) in enumerate(every[r]):
                within[chunk] = within.get(chunk, -1) + 1
                if peers and all(i >= len(p) or p[i] != (chunk, h) for p in peers):
                    return (chunk, within[chunk])
            return (float("inf"), 0)

        mine = [r for r, w in enumerate(self.ranks) if w[0] == dp]
        at = {r: first(r) for r in mine}
        return min(mine, key=lambda r: (at[r], r != suspect))
