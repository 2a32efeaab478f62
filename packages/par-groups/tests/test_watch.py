"""The watch over the counted layer: waits timed where a rank stands still, every call in the
flight recorder with its group's sequence number, and a summary naming the rank not arrived."""

import os
import pickle
import time
from pathlib import Path

import torch
import torch.distributed as dist

from par_groups import comm
from par_groups.flight import summarize
from par_groups.watch import CommWatch

LATE_S = 0.3


def _arrived(folder: str, name: str) -> None:
    """Rank 0 is about to wait: its clock's time now, for rank 1 (the clock is the machine's, one for all
    processes), written whole under a temporary name."""
    path = Path(folder) / name
    path.with_suffix(".tmp").write_text(repr(time.perf_counter()))
    os.replace(path.with_suffix(".tmp"), path)


def _later_than_rank_0(folder: str, name: str, seconds: float) -> None:
    """Rank 1 arrives ``seconds`` after rank 0 started waiting, whenever that was: however late a busy
    machine let rank 0 get there, it waits that long in the call (a fixed sleep on rank 1 left the margin
    to the scheduler)."""
    path = Path(folder) / name
    while not path.exists():
        time.sleep(0.005)
    time.sleep(max(0.0, float(path.read_text()) + seconds - time.perf_counter()))


def late_rank_1(folder: str):
    """Rank 1 reaches each call LATE_S after rank 0: rank 0 waits about that long, rank 1 hardly."""
    me = dist.get_rank()
    pair = dist.new_group([0, 1])  # the same ranks as the world, another group: its own label and numbers
    with CommWatch(capacity=8, names={(0, 1): "pair"}) as watch:
        x = torch.ones(3)
        if me == 1:
            _later_than_rank_0(folder, "blocking", LATE_S)
        else:
            _arrived(folder, "blocking")
        comm.all_reduce(x, None)  # blocking
        blocking = watch.take_wait()
        work = comm.all_gather_into_tensor(torch.empty(6), x, pair, async_op=True) if me == 0 else None
        if me == 1:  # rank 0 computed LATE_S/3 while the gather was in flight (not waiting), then waits
            _later_than_rank_0(folder, "overlapped", LATE_S * 2 / 3)
            work = comm.all_gather_into_tensor(torch.empty(6), x, pair, async_op=True)
        else:
            time.sleep(LATE_S / 3)
            _arrived(folder, "overlapped")
        work.wait()
        overlapped = watch.take_wait()
        peer = 1 - me
        ops = [dist.P2POp(dist.isend if me == 0 else dist.irecv, torch.ones(2), peer)]
        for w in comm.batch_isend_irecv(ops):
            w.wait()
        with comm.CommRecorder() as rec:  # the barrier and the object collectives: counted and watched too
            comm.barrier(None)
            views = [None, None]
            comm.all_gather_object(views, {"rank": me}, None)
            digests = [None, None] if me == 1 else None
            comm.gather_object(f"r{me}", digests, 1, pair)
        record = watch.record("test")
    calls = [(e["op"], e["group"], e["seq"], e["bytes"], e["peer"], e["state"]) for e in record["entries"]]
    return blocking, overlapped, calls, views, digests, [(r.op, r.bytes) for r in rec.records]


def test_waits_are_timed_where_the_rank_stands_still_and_calls_are_recorded(dist_run, tmp_path):
    (wait0, over0, entries0, *objects0), (wait1, over1, entries1, *objects1) = dist_run(2, late_rank_1, str(tmp_path))
    assert LATE_S * 0.8 < wait0 < LATE_S * 3 and wait1 < LATE_S * 0.5, (wait0, wait1)
    # rank 0 computed LATE_S/3 of rank 1's LATE_S lateness while the gather was in flight
    assert LATE_S * 0.4 < over0 < LATE_S * 3 and over1 < LATE_S * 0.5, (over0, over1)
    assert entries0[:2] == entries1[:2] == [("all_reduce", "world", 1, 12, None, "done"),
                                           ("all_gather", "pair", 1, 24, None, "done")]
    assert entries0[2] == ("send", "world", 1, 8, 1, "done") and entries1[2] == ("recv", "world", 1, 8, 0, "done")
    gathered = [{"rank": 0}, {"rank": 1}]
    assert objects0[:2] == [gathered, None] and objects1[:2] == [gathered, ["r0", "r1"]]
    one = len(pickle.dumps({"rank": 0}))
    sent = len(pickle.dumps("r0"))  # rank 0 sends its string to rank 1, which sends nothing
    assert objects0[2] == [("barrier", 0), ("all_gather_object", 2 * one), ("gather_object", sent)]
    assert objects1[2] == [("barrier", 0), ("all_gather_object", 2 * one), ("gather_object", 0)]
    assert [e[:3] for e in entries0[3:]] == [e[:3] for e in entries1[3:]] == [
        ("barrier", "world", 2), ("all_gather_object", "world", 3), ("gather_object", "pair", 2)]


def _entry(op, seq, ranks=(0, 1, 2, 3), group="dp", state="done", peer=None):
    return {"op": op, "seq": seq, "group": group, "ranks": list(ranks), "bytes": 64, "peer": peer, "state": state}


def _record(rank, entries, in_flight=None, where="train_loop.py:10 in step: x()"):
    return {"rank": rank, "entries": entries, "in_flight": in_flight, "stack": "", "where": where}


def test_the_summary_names_the_rank_behind_and_where_it_is():
    done = [_entry("all_reduce", 1), _entry("all_reduce", 2)]
    waiting = _entry("all_reduce", 3, state="waiting")
    records = {r: _record(r, done + [waiting], waiting) for r in (0, 2, 3)}
    stopped = summarize(records | {1: None}, 4, {1: "process stopped (SIGSTOP)"})
    assert stopped.rank == 1
    assert stopped.line == ("ranks 0, 2, 3 wait in all_reduce #3 on dp (ranks 0-3, 64 B); "
                            "not arrived: rank 1 (process stopped (SIGSTOP))")
    # rank 1 skipped call 3 and waits in another group: named, with where it waits instead
    elsewhere = _entry("broadcast", 1, ranks=(1, 3), group="tp", state="waiting")
    skipped = summarize(records | {1: _record(1, done + [elsewhere], elsewhere)}, 4)
    assert skipped.rank == 1 and "all_reduce #3 on dp" in skipped.line
    assert "rank 1 (waiting in broadcast #1 on tp (ranks 1, 3, 64 B) instead)" in skipped.line
    # out of any collective: where its stack was
    idle = summarize(records | {1: _record(1, done)}, 4)
    assert idle.rank == 1 and "rank 1 (in no collective at train_loop.py:10 in step: x())" in idle.line
    # a receive names its peer
    recv = _entry("recv", 1, ranks=(2, 3), group="pp", state="waiting", peer=3)
    p2p = summarize({2: _record(2, [recv], recv), 3: _record(3, [])}, 4)
    assert p2p.rank == 3 and p2p.line.startswith("rank 2 waits in recv from rank 3 on pp")
    assert summarize({r: _record(r, done) for r in range(4)}, 4) is None
    # a chain: ranks 0, 1 wait for rank 2, which waits in tp for rank 3 (stopped): rank 3 is named
    dp = _entry("all_reduce", 5, ranks=(0, 1, 2), state="waiting")
    tp = _entry("all_gather", 7, ranks=(2, 3), group="tp", state="waiting")
    early = [_entry("all_reduce", 4, ranks=(0, 1, 2))]
    chain = summarize({0: _record(0, early + [dp], dp), 1: _record(1, early + [dp], dp),
                       2: _record(2, early + [tp], tp), 3: None}, 4, {3: "stopped"})
    assert chain.rank == 3 and chain.line.startswith("rank 2 waits in all_gather #7 on tp"), chain.line
