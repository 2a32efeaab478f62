"""Check a schedule before anything runs it: completeness, F before B before W, and that in-order
execution with blocking receives (each rank runs its list in order and waits only for the
messages its next action needs) finishes, i.e. no send/recv deadlock."""

from __future__ import annotations

from collections import Counter

from .ir import Action, Schedule, action_key, dependencies


class ScheduleError(ValueError):
    """A schedule that cannot run as written; the message names the offending actions."""


def validate_schedule(schedule: Schedule) -> None:
    _check_complete(schedule)
    _check_local_order(schedule)
    execution_order(schedule)
    _check_message_streams(schedule)


def _check_complete(s: Schedule) -> None:
    seen: Counter = Counter()
    split_b = set()
    for rank, row in enumerate(s.ranks):
        for a in row:
            if not (0 <= a.microbatch < s.microbatches and 0 <= a.chunk < s.num_chunks):
                raise ScheduleError(f"{s.name}: rank {rank} has {a}, outside microbatches={s.microbatches}, chunks={s.num_chunks}")
            if s.chunk_ranks[a.chunk] != rank:
                raise ScheduleError(f"{s.name}: {a} runs on rank {rank} but chunk {a.chunk} lives on rank {s.chunk_ranks[a.chunk]}")
            seen[action_key(a)] += 1
            if a.split:
                split_b.add((a.microbatch, a.chunk))
    for m in range(s.microbatches):
        for c in range(s.num_chunks):
            for kind in "FB":
                if seen[Action(kind, m, c)] != 1:
                    raise ScheduleError(f"{s.name}: {kind} of microbatch {m} chunk {c} appears {seen[Action(kind, m, c)]} times, expected once")
            want_w = int((m, c) in split_b)
            if seen[Action("W", m, c)] != want_w:
                raise ScheduleError(f"{s.name}: microbatch {m} chunk {c} has {seen[Action('W', m, c)]} W actions; a split B needs exactly one W, a full B none")


def _check_local_order(s: Schedule) -> None:
    for rank, row in enumerate(s.ranks):
        position = {action_key(a): i for i, a in enumerate(row)}
        for a in row:
            for dep in dependencies(s, a):
                if s.chunk_ranks[dep.chunk] == rank and position[dep] > position[action_key(a)]:
                    raise ScheduleError(f"{s.name}: rank {rank} runs {a} before {dep}, which it depends on")


def execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """One global order in which in-order ranks can run every action; raises on deadlock."""
    done: set[Action] = set()
    heads = [0] * schedule.pp
    order: list[tuple[int, Action]] = []
    total = sum(len(r) for r in schedule.ranks)
    while len(order) < total:
        progressed = False
        for rank, row in enumerate(schedule.ranks):
            while heads[rank] < len(row) and all(d in done for d in dependencies(schedule, row[heads[rank]])):
                a = row[heads[rank]]
                done.add(action_key(a))
                order.append((rank, a))
                heads[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(row[heads[r]]) for r, row in enumerate(schedule.ranks) if heads[r] < len(row)}
            raise ScheduleError(f"{schedule.name}: deadlock, each rank waits on a message never sent: {stuck}")
    return order


def _check_message_streams(s: Schedule) -> None:
    """Every receive has exactly one matching send, so per-pair FIFO streams line up."""
    sent = Counter(m for r in range(s.pp) for m in s.sends(r))
    received = Counter(m for r in range(s.pp) for m in s.recvs(r))
    if sent != received:
        raise ScheduleError(f"{s.name}: sends and receives differ: {dict(sent - received)} unreceived, {dict(received - sent)} never sent")
