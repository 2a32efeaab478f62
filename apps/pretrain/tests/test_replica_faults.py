"""``[train].fault_tolerance = "replica"``: a real SIGKILL of one rank; its replica is fenced, the others regroup
without a restart, and every step's loss and grad norm are the uninterrupted run's (fp32, 1e-6), every
global sample of every step trained exactly once, no process left behind.

The default tier kills one rank of dp3 in the gradient reduction: the two survivors then split the
step's three micro-batches 2 + 1, which catches a loss normalised by the participants (torchft's
choice) and a lost replica's micro-batches dropped; a new generation over a used store prefix is refused.
dp2 with Muon killed in its optimizer step: the survivor's step fails in Muon's collectives before any state
changes, and the replacement receives the momentum (state Muon unpacks into copies) bitwise. A dp3 rank
whose every matmul is wrong (persistent silent corruption) has its replica dropped, never replaced.
The extended tier: the other phases, dp2, dp2 x tp2, dp2 x cp2, MTP, eod_mask_loss, ZeRO-2 with buddy shards, a
background checkpoint save in flight, two losses in a row, a replacement that rejoins (its state from a live
replica, checked bitwise) and one killed while it receives its state; a rank with an odd copy of a weight
(dropped as a persistent rank is), and one renumbered by a regroup, named by the launcher's rank.
"""

import functools
import json
import math
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pretrain.cli import app

runner = CliRunner()


def _pp(layout: tuple, key: str = "pp") -> int:
    """``[parallel].<key>`` (pp, cp) that ``layout`` sets, else 1."""
    return next((int(a.split("=")[1]) for a in layout if a.startswith(f"parallel.{key}=")), 1)


def _run(tmp: Path, dp: int, *extra: str, tp: int = 1, layout: tuple = ()):
    return runner.invoke(app, ["train", "--nproc", str(dp * tp * _pp(layout) * _pp(layout, "cp")), *_settings(tmp, dp, *extra, tp=tp, layout=layout)])


def _settings(tmp: Path, dp: int, *extra: str, tp: int = 1, layout: tuple = ()) -> list[str]:
    return ["--set", f"parallel.tp={tp}", "--set", "model.layers=2", "--set", "model.hidden=32", "--set", "model.ffn_hidden=64",
            "--set", "train.steps=4", "--set", "train.warmup_steps=1", "--set", "train.eval_every=0",
            "--set", "train.seq_len=16", "--set", f"train.global_batch={2 * dp}", "--set", "log.progress=false",
            "--set", "log.timing=false", "--set", "log.flight_records=0", "--set", "train.collective_timeout_s=60",
            "--set", f"log.dir={tmp / 'log'}", "--set", f"checkpoint.dir={tmp / 'ck'}", *layout, *extra]


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in (log / "log.jsonl").read_text().splitlines()]


def _curve(log: Path) -> dict[int, tuple[float, float]]:
    steps = [r for r in _records(log) if "loss" in r and "event" not in r]
    assert len(steps) == len({r["step"] for r in steps}), "a step logged twice"
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in steps}


@functools.cache
def _reference(dp: int, root: str, tp: int = 1, layout: tuple = ()) -> dict[int, tuple[float, float]]:
    """The uninterrupted run, without fault tolerance (the plain trainer). A run this process finished before is read
    back from its folder: the module is imported twice (by pytest, and by name by test_replica_faults_*.py), each
    copy with its own cache, over the one folder."""
    name = f"ref{dp}x{tp}-" + "-".join(a.replace("=", "_") for a in layout if a != "--set")
    done = Path(root) / name / "finished"
    if not done.exists():
        res = _run(Path(root) / name, dp, tp=tp, layout=layout)
        assert res.exit_code == 0, res.output
        done.touch()
    return _curve(Path(root) / name / "log")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    # one folder per test process, whichever module asks (test_replica_faults_*.py import this fixture): `_reference`'s
    # cache then runs each uninterrupted layout once per process, not once per module
    root = tmp_path_factory.getbasetemp() / "reference"
    root.mkdir(exist_ok=True)
    root = str(root)
    curve = lambda dp, tp=1, layout=(): _reference(dp, root, tp, layout)  # noqa: E731
    curve.root = Path(root)  # each uninterrupted run's folder: ref<dp>x<tp>-<layout> (its log and checkpoints)
    return curve


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _run_nodes(tmp: Path, dp: int, nodes: int, kill: dict, *extra: str, tp: int = 1, layout: tuple = (),
               store: str = "node0", port_of=None) -> tuple[list[int], str]:
    """The run as ``nodes`` `pretrain train` launchers, each its own process (a "node" on 127.0.0.1, ``--nproc``
    the world's share) in a session of its own, node 0 hosting the store at a named endpoint; their ranks run
    ``sigkill_at(**kill)``. ``store="external"``: the store is `pretrain store`'s, every node its client;
    ``"torchrun"``: the same store, each node a torchrun (``--standalone --max-restarts 1``) whose workers run
    `pretrain train`. ``port_of(k, port)``: the port node ``k`` reaches the store at (a proxy's). Every node's exit
    code and every node's console."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here, bin = Path(__file__).parent, Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONPATH": os.pathsep.join([str(here), env.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    nproc = dp * tp * _pp(layout) * _pp(layout, "cp") // nodes
    server = None
    if store != "node0":
        server = subprocess.Popen([str(bin / "pretrain"), "store", "--host", "127.0.0.1", "--port", str(port)], env=env,
                                  stderr=subprocess.PIPE, text=True)
        assert "listening" in server.stderr.readline()
    launcher = [sys.executable] if store != "torchrun" else [
        str(bin / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1",
        "--monitor-interval", "0.1"]
    flags = ["--external-store"] if store == "external" else []

    def argv(k: int) -> list[str]:  # torchrun would read the train flags as its own: in the JSON (node_launcher.py)
        train = ["--nproc", str(nproc), "--nnodes", str(nodes), "--node-rank", str(k), "--rdzv-endpoint",
                 f"127.0.0.1:{port if port_of is None else port_of(k, port)}", *flags, *_settings(tmp, dp, *extra, tp=tp, layout=layout)]
        return [json.dumps(kill | {"train": train})] if store == "torchrun" else [json.dumps(kill), *train]

    procs = [subprocess.Popen([*launcher, str(here / "node_launcher.py"), *argv(k)], start_new_session=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in range(nodes)]
    try:
        deadline = time.monotonic() + 240
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:  # a hang: no node left behind (its session: the launcher and its ranks)
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    finally:
        if server is not None:
            server.terminate()
            assert server.wait(timeout=30) == 0
    codes = [p.returncode for p in procs]
    return codes, "\n".join(f"node {k} (exit {c}):\n{o}" for k, (c, o) in enumerate(zip(codes, outputs)))


def _check_fault_run(tmp: Path, dp: int, rank: int, step: int, phase: str, reference, tp: int = 1,
                     also: tuple = (), respawn: bool = False, layout: tuple = (), admit_before: int = 0,
                     shard: int = 1, reference_layout: tuple | None = None, stale_step: bool = False,
                     nodes: int = 1, stall: tuple = (), store: str = "node0", whole_node: bool = False,
                     entry=None, updates: int = 4) -> list[dict]:
    """``layout``: more ``--set`` arguments of both runs (``reference_layout``: the uninterrupted run's, if other).
    ``admit_before``: a replacement rejoins before that step, and the replicas end bitwise equal on every owned
    piece (with buddy shards: each rank's buddy range equal to the next replica's own). ``shard``: data ranks
    per replica (HSDP). ``stale_step``: plant a joiner that keeps a stale optimizer step count. ``nodes``: the run as
    that many launchers sharing node 0's store (:func:`_run_nodes`; ``store``: whose), each node exiting 0;
    ``whole_node``: ``rank`` kills its node whole (launcher and ranks), whose exit is then SIGKILL's. ``entry``: the
    ranks' entry, called as ``replica_kills.sigkill_at`` (which it defaults to). ``updates``: the optimizer steps taken
    (fewer than the steps where an update is skipped)."""
    import replica_kills

    pids = tmp / "pids"
    pids.mkdir()
    entry = functools.partial(entry or replica_kills.sigkill_at, rank, step, phase, str(pids), also=also,
                              admit_before=admit_before, stale_step=stale_step, stall=stall)
    respawn = respawn or bool(admit_before)
    fault = ("--set", "train.fault_tolerance=replica", "--set", f"train.respawn={str(respawn).lower()}",
             "--set", "log.sample_ids=true")
    if nodes > 1:
        kill = {"args": [rank, step, phase, str(pids)], "kwargs": dict(also=also, admit_before=admit_before,
                                                                      stale_step=stale_step, whole_node=whole_node,
                                                                      stall=stall)}
        codes, output = _run_nodes(tmp, dp, nodes, kill, *fault, tp=tp, layout=layout, store=store)
        dead = rank // (dp * tp * _pp(layout) * _pp(layout, "cp") // nodes) if whole_node else None
        assert [c for k, c in enumerate(codes) if k != dead] == [0] * (nodes - (dead is not None)), output
        assert dead is None or codes[dead] == -9, output
    else:
        with pytest.MonkeyPatch.context() as m:
            m.setattr("pretrain.training.run.run_rank", entry)
            res = _run(tmp, dp, *fault, tp=tp, layout=layout)
        assert res.exit_code == 0, res.output
    log = tmp / "log"
    expected, got = reference(dp, tp, layout if reference_layout is None else reference_layout), _curve(log)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for s, (loss, norm) in expected.items():
        assert math.isclose(got[s][0], loss, rel_tol=1e-6), (s, got[s], (loss, norm))
        assert math.isclose(got[s][1], norm, rel_tol=1e-6), (s, got[s], (loss, norm))
    lost = [r for r in _records(log) if r.get("event") == "replica_lost"]
    # the interrupted step is redone, unless the survivors completed it (the lost rank had sent its gradient)
    world, pp = dp * tp * _pp(layout) * _pp(layout, "cp"), _pp(layout)
    inner = tp * _pp(layout, "cp")  # the ranks below dp in the order tp-cp-ep-dp-pp
    block = inner * shard * pp  # a replica's ranks (an HSDP replica: consecutive dp ranks)

    def replica_of(r: int) -> int:
        return (r // inner) % dp // shard

    replica = [r for r in range(world) if replica_of(r) == replica_of(rank)]
    assert len(lost) == 1 + len(also) and lost[0]["ranks"] == replica and lost[0]["step"] in (step - 1, step), lost
    # every survivor noticed at once (a closed connection), none waited for a collective's timeout: a survivor
    # that went on to the next generation let go of the old one's groups, which closes them under a late one
    assert all(e["noticed_at_timeout"] == 0 for e in lost), lost
    # every global sample of every step in its gradient exactly once: the latest generation's record of a step counts
    records = [json.loads(line) for f in (log / "samples").iterdir() for line in f.read_text().splitlines()]
    for s in range(1, 5):
        latest = max(r["generation"] for r in records if r["step"] == s)
        ids = sorted(i for r in records if r["step"] == s and r["generation"] == latest for i in r["samples"])
        assert ids == list(range((s - 1) * 2 * dp, s * 2 * dp)), (s, ids)
    left = [int(p.name) for p in pids.glob("[0-9]*") if _alive(int(p.name))]
    started = len(list(pids.glob("[0-9]*")))  # a replacement never admitted may be stopped before its entry ran
    assert (started == world or respawn and started == world + block) and not left, (started, left)
    if admit_before:
        joined = [r for r in _records(log) if r.get("event") == "replica_joined"]
        assert [(e["step"], e["ranks"]) for e in joined] == [(admit_before - 1, replica)], joined
        states = [json.loads((pids / f"state_{r}.json").read_text()) for r in range(world)]
        buddies = [json.loads((pids / f"buddy_{r}.json").read_text()) for r in range(world)]
        for r in range(world):
            if buddies[r]:  # ZeRO-1 shards with buddies: each rank's buddy range is the next replica's own shard
                after = r + ((replica_of(r) + 1) % (dp // shard) - replica_of(r)) * shard * inner
                assert buddies[r] == {k: states[after][k] for k in buddies[r]}, r
            else:  # every owned piece, by size and SHA-256, equal to its coordinate's in replica 0
                assert states[r] == states[r - replica_of(r) * shard * inner], r
        assert states[0], "no owned pieces"
        # the joiner's optimizer counts the steps the live replicas count (AdamW's bias correction)
        counts = [int((pids / f"optimizer_steps_{r}").read_text()) for r in range(world)]
        assert counts == [updates] * world, counts
        # the bytes `plan` says a joiner receives: the sum of the pieces it owns
        plan = runner.invoke(app, ["plan", "--world", str(world), "--json",
                                   *_settings(tmp, dp, "--set", "train.fault_tolerance=replica", tp=tp, layout=layout)])
        assert plan.exit_code == 0, plan.output
        owned = [sum(size for held in (states[r], buddies[r]) for boxes in held.values() for size, _ in boxes)
                 for r in replica]
        planned = json.loads(plan.output)["fault_tolerance"]["joiner_bytes"]
        if any(buddies):  # ZeRO-1 pads each bucket to a multiple of dp, which plan's ceil(params / dp) does not see
            assert max(owned) <= planned <= max(owned) * 1.001, (planned, owned)
        else:
            assert planned == max(owned), (plan.output[-200:], owned)
    return lost


@pytest.mark.timeout(300)
def test_dp3_rank_killed_in_the_gradient_reduction_goes_on_with_the_uninterrupted_curve(tmp_path, reference,
                                                                                         fault_ranks):
    _check_fault_run(tmp_path, 3, 2, 3, "reduction", reference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,tp,bad", [(3, 1, 1)] + [pytest.param(*c, marks=pytest.mark.extended)
                                                     for c in [(2, 1, 1), (2, 2, 3), (2, 1, 0)]])
def test_a_rank_that_computes_wrong_persistently_has_its_replica_dropped_not_replaced(tmp_path, reference, fault_ranks,
                                                                                    dp, tp, bad):
    """Every matmul of rank ``bad`` is wrong from the start (rank 0: the log's holder is lost; dp3: the two
    survivors split three micro-batches unevenly, and compare their losses unscaled). The check at step 1,
    before its update, names the rank; its replica leaves (fenced as for a death, with ``respawn`` on and no
    replacement started: its device computes wrong), the others redo step 1 with its micro-batches, and the
    curve is the uninterrupted run's without the fault (fp32, 1e-6) from step 1 on: the wrong step was
    never applied."""
    import replica_kills

    pids = tmp_path / "pids"
    pids.mkdir()
    with pytest.MonkeyPatch.context() as m:
        m.setattr("pretrain.training.run.run_rank", functools.partial(replica_kills.injected, f"matmul:{bad}", str(pids)))
        res = _run(tmp_path, dp, "--set", "train.fault_tolerance=replica", "--set", "train.respawn=true",
                   "--set", "log.sample_ids=true", tp=tp)
    assert res.exit_code == 0, res.output
    log = tmp_path / "log"
    events = [r for r in _records(log) if r.get("event") in ("corruption", "replica_lost", "replica_joined")]
    replica = [r for r in range(dp * tp) if r // tp == bad // tp]
    assert [(e["event"], e["step"]) for e in events] == [("replica_lost", 0), ("corruption", 1)], events
    assert events[0]["ranks"] == replica and events[0]["replica"] == bad // tp, events
    assert (events[1]["class"], events[1]["rank"], events[1]["gpu"]) == ("persistent", bad, "cpu") and events[1]["host"]
    expected, got = reference(dp, tp), _curve(log)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for s, (loss, norm) in expected.items():
        assert math.isclose(got[s][0], loss, rel_tol=1e-6) and math.isclose(got[s][1], norm, rel_tol=1e-6), (s, got[s])
    records = [json.loads(line) for f in (log / "samples").iterdir() for line in f.read_text().splitlines()]
    for s in range(1, 5):  # the survivors trained every sample of every step (the latest generation's records)
        latest = max(r["generation"] for r in records if r["step"] == s)
        ids = sorted(i for r in records if r["step"] == s and r["generation"] == latest for i in r["samples"])
        assert latest == 1 and ids == list(range((s - 1) * 2 * dp, s * 2 * dp)), (s, ids)
    started = [int(p.name) for p in pids.glob("[0-9]*")]
    assert len(started) == dp * tp and not [p for p in started if _alive(p)], started  # no replacement, none left


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,rank,step,phase", [(2, 1, 2, "forward"), (2, 0, 3, "backward"), (2, 1, 4, "optimizer"),
                                                (3, 1, 2, "forward"), (3, 0, 3, "backward"), (3, 1, 4, "optimizer"),
                                                (3, 0, 1, "reduction")])
def test_a_replica_killed_in_each_phase_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks,
                                                                            dp, rank, step, phase):
    _check_fault_run(tmp_path, dp, rank, step, phase, reference)


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_replacement_rejoins_with_the_live_replica_state_and_the_curve_goes_on(tmp_path, reference, fault_ranks):
    import replica_kills

    pids = tmp_path / "pids"
    pids.mkdir()
    entry = functools.partial(replica_kills.sigkill_at, 1, 2, "forward", str(pids), admit_before=4)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("pretrain.training.run.run_rank", entry)
        res = _run(tmp_path, 3, "--set", "train.fault_tolerance=replica", "--set", "train.respawn=true",
                   "--set", "log.sample_ids=true")
    assert res.exit_code == 0, res.output
    log = tmp_path / "log"
    expected, got = reference(3), _curve(log)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for s, (loss, norm) in expected.items():
        assert math.isclose(got[s][0], loss, rel_tol=1e-6) and math.isclose(got[s][1], norm, rel_tol=1e-6), (s, got[s])
    events = [r for r in _records(log) if "event" in r]
    assert [(e["event"], e["step"], e["ranks"]) for e in events] == [("replica_lost", 1, [1]), ("replica_joined", 3, [1])]
    # the replicas end bitwise equal, piece by piece; the joiner received exactly the pieces it owns (and its RNG)
    states = [json.loads((pids / f"state_{r}.json").read_text()) for r in (0, 1, 2)]
    assert states[0] == states[1] == states[2]
    owned = sum(size for boxes in states[1].values() for size, _ in boxes)
    assert owned < events[1]["bytes_moved"] <= owned + 10_000, (owned, events[1])
    records = [json.loads(line) for f in (log / "samples").iterdir() for line in f.read_text().splitlines()]
    assert max(r["generation"] for r in records) == 2
    for s in range(1, 5):
        latest = max(r["generation"] for r in records if r["step"] == s)
        ids = sorted(i for r in records if r["step"] == s and r["generation"] == latest for i in r["samples"])
        assert ids == list(range((s - 1) * 6, s * 6)), (s, ids)
    assert len(list(pids.glob("[0-9]*"))) == 4 and not [p for p in pids.glob("[0-9]*") if _alive(int(p.name))]


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase,admit_before", [(3, "backward", 0), (0, "reduction", 0), (2, "optimizer", 4)])
def test_dp2_x_tp2_a_replica_killed_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, rank, phase,
                                                                         admit_before):
    _check_fault_run(tmp_path, 2, rank, 2, phase, reference, tp=2, admit_before=admit_before)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stall", [(), ((0, 2, "reduction", 3.0),)], ids=["", "a-survivor-late"])
def test_dp3_two_replicas_lost_in_a_row_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, stall):
    """``a-survivor-late``: rank 0 enters the interrupted step's reduction late, after rank 2 waits there on it;
    rank 0 notices the loss first and leaves for the next generation, whose rendezvous waits for rank 2. Rank 2
    must fail at once (rank 0 shut its connections of the left generation), not at the collective's timeout,
    while rank 0 waits out the same timeout in the rendezvous (the race that failed the run)."""
    lost = _check_fault_run(tmp_path, 3, 1, 2, "forward", reference, also=((2, 3),), stall=stall)
    assert [(e["step"], e["ranks"], e["replicas_left"]) for e in lost] == [(1, [1], 2), (2, [2], 1)]


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_dp3_a_survivor_lost_in_the_regroup_is_passed_over_and_the_curve_goes_on(tmp_path, reference, fault_ranks):
    """Rank 2 dies in the regroup after rank 1's loss, before it arrives at generation 1: rank 0, waiting for
    generation 1's members, goes on to generation 2 (published without rank 2) instead of waiting for rank 2 in
    generation 1's group creation until its timeout. Both losses are logged."""
    lost = _check_fault_run(tmp_path, 3, 1, 2, "forward", reference, also=((2, 2, "regroup"),))
    assert [(e["step"], e["ranks"], e["replicas_left"], e["generation"]) for e in lost] == [(1, [1], 2, 1), (1, [2], 1, 2)]


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("buddies", [False, True])
def test_a_replacement_killed_while_it_receives_its_state_is_replaced_again(tmp_path, reference, fault_ranks, buddies):
    """Point to point from the live replica, or (ZeRO-1 with buddy shards) in the re-sharding collectives."""
    import replica_kills

    pids = tmp_path / "pids"
    pids.mkdir()
    entry = functools.partial(replica_kills.sigkill_at, 1, 2, "forward", str(pids), admit_before=3, joiner_dies=True)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("pretrain.training.run.run_rank", entry)
        res = _run(tmp_path, 2, "--set", "train.fault_tolerance=replica", "--set", "log.sample_ids=true",
                   layout=BUDDY if buddies else ())
    assert res.exit_code == 0, res.output
    assert (pids / "joiner_died").exists()
    expected, got = reference(2, layout=ZERO1 if buddies else ()), _curve(tmp_path / "log")
    for s, (loss, norm) in expected.items():
        assert math.isclose(got[s][0], loss, rel_tol=1e-6) and math.isclose(got[s][1], norm, rel_tol=1e-6), (s, got[s])
    events = [(r["event"], r["step"]) for r in _records(tmp_path / "log") if "event" in r]
    assert events == [("replica_lost", 1), ("replica_lost", 2), ("replica_joined", 2)], events
    states = [json.loads((pids / f"state_{r}.json").read_text()) for r in (0, 1)]
    buddy = [json.loads((pids / f"buddy_{r}.json").read_text()) for r in (0, 1)]
    if buddies:  # each rank's buddy range is the other's own shard
        assert all(buddy[r] and buddy[r] == {k: states[1 - r][k] for k in buddy[r]} for r in (0, 1))
    else:
        assert states[0] == states[1]
    assert len(list(pids.glob("[0-9]*"))) == 4 and not [p for p in pids.glob("[0-9]*") if _alive(int(p.name))]


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_replacement_not_admitted_before_the_last_step_is_stopped_and_the_run_exits_0(tmp_path, reference, fault_ranks):
    _check_fault_run(tmp_path, 2, 1, 4, "forward", reference, respawn=True)


@pytest.mark.extended  # two launcher processes, each importing torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase,admit_before", [
    pytest.param(1, "forward", 4, marks=pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason=(
        "two launchers with a rejoin: test_replica_faults_spanning.py's proves it: PAR_FULL_MATRIX=1"))),
    (1, "reduction", 0)])
def test_two_launchers_one_replica_per_node_a_rank_of_node_1_killed_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference, rank, phase, admit_before):
    """Two `pretrain train` launchers ("nodes" on 127.0.0.1, one replica each) sharing node 0's store: node 1's
    launcher fences its replica and publishes the loss, node 0's rank regroups alone, node 1 starts the
    replacement (``admit_before``), and both nodes exit 0 with the uninterrupted run's curve."""
    _check_fault_run(tmp_path, 2, rank, 2, phase, reference, admit_before=admit_before, respawn=True, nodes=2)



@pytest.mark.extended  # a store process and two launcher processes, each importing torch
@pytest.mark.timeout(300)
def test_a_store_no_node_hosts_outlives_node_0_killed_whole_and_node_1_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference):
    """`pretrain store` holds the job's store, both launchers its clients (``--external-store``): rank 0 SIGKILLs its
    node's whole process group (launcher and ranks) in its forward; no launcher publishes that loss, so node 1's
    survivor claims it (after checking in and a settling time), regroups alone, takes over the log as the lowest live
    rank, and exits 0 with the uninterrupted run's curve."""
    _check_fault_run(tmp_path, 2, 0, 2, "forward", reference, nodes=2, store="external", whole_node=True)


@pytest.mark.extended  # a store process, two torchrun agents and their workers, each importing torch
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,tp,step,admit_before", [
    pytest.param(1, 1, 2, 4, marks=pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"),
                                                      reason="dp2xtp2 proves the same restart and rejoin: PAR_FULL_MATRIX=1")),
    (1, 1, 4, 0), pytest.param(3, 2, 2, 4, marks=pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason=(
        "test_replica_faults_nodes.py's late-survivor case proves the same restart and rejoin: PAR_FULL_MATRIX=1")))],
    ids=["dp2", "dp2-last-step", "dp2xtp2"])
def test_two_torchruns_one_replica_each_a_worker_killed_is_restarted_by_its_agent_and_rejoins(
        tmp_path, reference, rank, tp, step, admit_before):
    """One torchrun per "node" (``--standalone``, its own rendezvous over its workers), every worker a rank of the job
    through `pretrain store` (``--nnodes 2 --node-rank K --rdzv-endpoint``): a worker of node 1 SIGKILLed in its
    forward; node 0's survivors claim the loss and go on alone, node 1's agent stops the replica's other worker (dp2
    x tp2: two workers per torchrun) and restarts its workers once (``--max-restarts 1``), which rejoin as the
    replacement before step 4 with the live replica's state bitwise; both torchruns exit 0 with the uninterrupted
    run's curve. Killed in the last step, the replacement may come too late to be admitted: it sees every member
    returned and exits 0 itself (no launcher of ours stops it)."""
    _check_fault_run(tmp_path, 2, rank, step, "forward", reference, tp=tp, admit_before=admit_before, respawn=True,
                     nodes=2, store="torchrun")


@pytest.mark.extended  # two launcher processes, each importing torch
@pytest.mark.timeout(300)
def test_two_launchers_node_1_lost_whole_is_noticed_at_its_heartbeat_and_the_curve_goes_on(tmp_path, reference):
    """Node 1's launcher, its forkserver and its rank SIGKILLed together (its process group) in step 2's forward:
    no launcher of node 1 is left to publish the loss. Node 0's launcher sees node 1's heartbeat stop for
    ``node_timeout_s`` and publishes the next generation; with ``join_timeout_s`` an hour, the survivor could not
    go on otherwise within the test's timeout. Node 0 exits 0 with the uninterrupted curve."""
    lost = _check_fault_run(tmp_path, 2, 1, 2, "forward", reference, nodes=2, whole_node=True, reference_layout=(),
                            layout=("--set", "train.join_timeout_s=3600", "--set", "train.node_timeout_s=6"))
    # (node_timeout_s 6, not less: node 1 holds its heartbeat as a lease of half of it, which a loaded machine must
    # not starve before the kill)
    assert [(e["node"], e["generation"], e["ranks"]) for e in lost] == [(1, 1, [1])], lost


@pytest.mark.extended  # two launcher processes, each importing torch
@pytest.mark.timeout(300)
def test_two_launchers_without_fault_tolerance_a_rank_killed_on_node_1_is_named_on_node_0(tmp_path):
    """Node 0's rank fails only with a closed connection; its launcher shows node 1's line, not that."""
    (tmp_path / "pids").mkdir()
    codes, output = _run_nodes(tmp_path, 2, 2, {"args": [1, 2, "forward", str(tmp_path / "pids")], "kwargs": {}})
    node0 = output.split("node 1 (exit")[0]
    assert codes == [1, 1] and "node 0 (exit 1)" in output and "node 1 (exit 1)" in output, output
    errors = [line for line in node0.splitlines() if line.startswith("error:")]
    assert errors == ["error: node 1 failed: rank 1 failed: exited with code -9 (signal SIGKILL)"], output

MUON = ("--set", "train.optimizer=muon")


@pytest.mark.timeout(300)
def test_dp2_muon_killed_in_the_optimizer_step_rejoins_with_the_momentum_bitwise(tmp_path, reference, fault_ranks):
    _check_fault_run(tmp_path, 2, 0, 2, "optimizer", reference, layout=MUON, admit_before=4)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,step,phase,admit_before", [(1, 2, "forward", 0), (1, 2, "reduction", 4)])
def test_dp2_muon_a_replica_killed_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, rank, step,
                                                                        phase, admit_before):
    _check_fault_run(tmp_path, 2, rank, step, phase, reference, layout=MUON, admit_before=admit_before)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_replica_killed_in_a_checkpoint_save_discards_it_and_the_final_checkpoint_resumes_bitwise(
        tmp_path, reference, fault_ranks, tmp_path_factory, rank):
    every = ("--set", "checkpoint.every=2")
    _check_fault_run(tmp_path, 2, rank, 2, "save", reference, layout=every)
    ck = tmp_path / "ck"
    # the interrupted save is never published (no rank finished it); the final one is, complete
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_4"], sorted(ck.iterdir())
    # both final checkpoints, the interrupted run's and the uninterrupted's, resume into the same fifth step
    fifth = []
    for root in (tmp_path, tmp_path_factory.mktemp("uninterrupted")):
        if root != tmp_path:
            res = _run(root, 2, layout=every)
            assert res.exit_code == 0, res.output
        res = _run(root, 2, "--set", "train.steps=5", "--set", "checkpoint.resume=true", layout=every)
        assert res.exit_code == 0, res.output
        fifth.append(_curve(root / "log")[5])
    assert fifth[0] == fifth[1], fifth


EOD = ("--set", "data.eod_mask_loss=true", "--set", "train.seq_len=64")


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_dp3_eod_mask_loss_killed_in_the_reduction_normalises_by_the_global_kept_tokens(tmp_path, reference, fault_ranks):
    """[data].eod_mask_loss: the loss is divided by the global batch's kept predictions (an all-reduce over the
    survivors, who hold every micro-batch between them), so the 2 + 1 split needs no participants' weight on
    top; one (the dp3 planted bug's) would make the second survivor's micro-batch count double."""
    _check_fault_run(tmp_path, 3, 2, 3, "reduction", reference, layout=EOD)


MTP = ("--set", "model.mtp_depth=1")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,rank,step,phase,admit_before", [(3, 2, 3, "reduction", 0), (2, 1, 2, "backward", 4)])
def test_mtp_a_replica_killed_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, dp, rank, step,
                                                                  phase, admit_before):
    """Multi-token prediction: its loss rides on the main loss's gradient, weighted with it; its layers are owned
    pieces like the others (a joiner receives them)."""
    _check_fault_run(tmp_path, dp, rank, step, phase, reference, layout=MTP, admit_before=admit_before)


CP2 = ("--set", "parallel.cp=2")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase,admit_before", [(3, "backward", 0), (0, "reduction", 4)])
def test_dp2_x_cp2_a_replica_killed_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, rank, phase,
                                                                         admit_before):
    """Context parallelism lies inside a replica's block: its cp group is rebuilt with the generation's groups."""
    _check_fault_run(tmp_path, 2, rank, 2, phase, reference, layout=CP2, admit_before=admit_before)


ASYNC = ("--set", "checkpoint.every=2", "--set", "checkpoint.async_save=true", "--set", "checkpoint.keep=3")


def _resume_from(ck: Path, name: str, root: Path, layout: tuple) -> tuple[float, float]:
    """The step after checkpoint ``ck/name`` (a copy of it alone, ``latest`` naming it), resumed at dp2."""
    import shutil

    root.mkdir()
    shutil.copytree(ck / name, root / "ck" / name)
    (root / "ck" / "latest").write_text(name + "\n")
    after = int(name.split("_")[1]) + 1
    res = _run(root, 2, "--set", f"train.steps={after}", "--set", "checkpoint.resume=true", layout=layout)
    assert res.exit_code == 0, res.output
    return _curve(root / "log")[after]


@pytest.mark.extended
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rank,step,phase,admit_before", [(1, 2, "save", 0), (0, 2, "save", 0), (1, 3, "forward", 0),
                                                           (0, 2, "save", 4)])
def test_a_replica_killed_while_a_background_save_is_in_flight_loses_no_checkpoint(tmp_path, reference, fault_ranks,
                                                                                   rank, step, phase, admit_before):
    """[checkpoint].async_save: a rank killed in its save's publishing thread (its files written, the next step
    training), or in the next step's forward while the save may still be in flight. The survivors' save fails with
    the lost peer; the new generation writes it again (same step, same state): every checkpoint of the
    uninterrupted run is there, intact, and each resumes into the uninterrupted run's next step bitwise. With a
    replacement admitted (a save of the smaller generation may be in flight then: it is finished first), the
    replicas end bitwise equal."""
    _check_fault_run(tmp_path, 2, rank, step, phase, reference, layout=ASYNC, admit_before=admit_before)
    ck, uninterrupted = tmp_path / "ck", reference.root / ("ref2x1-" + "-".join(a.replace("=", "_") for a in ASYNC
                                                                              if a != "--set")) / "ck"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_2", "step_4"], sorted(ck.iterdir())
    assert (ck / "latest").read_text().strip() == "step_4"
    for name in ("step_2", "step_4"):
        res = runner.invoke(app, ["verify", str(ck / name)])
        assert res.exit_code == 0, res.output
        if phase == "save" and rank == 1 or name == "step_2":
            got = _resume_from(ck, name, tmp_path / f"resume-{name}", ASYNC)
            assert got == _resume_from(uninterrupted, name, tmp_path / f"uninterrupted-{name}", ASYNC), name


HSDP = ("--set", "parallel.zero=optim_grads_params", "--set", "parallel.hsdp_replicas=2")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase,admit_before", [(3, "backward", 0), (1, "optimizer", 4)])
def test_hsdp_2x2_a_replica_killed_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, rank, phase,
                                                                         admit_before):
    _check_fault_run(tmp_path, 4, rank, 2, phase, reference, layout=HSDP, admit_before=admit_before, shard=2)


ZBV = ("--set", "parallel.pp=2", "--set", "parallel.schedule=zb-v", "--set", "model.layers=4")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,phase,admit_before", [(3, "forward", 0), (1, "optimizer", 4)])
def test_dp2_x_pp2_zbv_a_pipeline_killed_goes_on_with_the_uninterrupted_curve(tmp_path, reference, fault_ranks, rank,
                                                                              phase, admit_before):
    _check_fault_run(tmp_path, 2, rank, 2, phase, reference, layout=ZBV, admit_before=admit_before)


def _moe(balance: str) -> tuple:
    return ("--set", "model.num_experts=4", "--set", "model.top_k=2", "--set", "model.moe_ffn_hidden=32",
            "--set", "parallel.ep=2", "--set", f"model.expert_balance={balance}")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("balance,rank,phase,admit_before", [("replicate", 3, "backward", 0), ("replicate", 1, "optimizer", 4),
                                                             ("none", 2, "optimizer", 4)])
def test_dp2_x_ep2_with_expert_balancing_a_replica_killed_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference, fault_ranks, balance, rank, phase, admit_before):
    """An expert-parallel group holds one copy of the experts between its ranks: it is the failure domain."""
    _check_fault_run(tmp_path, 4, rank, 2, phase, reference, layout=_moe(balance), admit_before=admit_before, shard=2)


ZERO1 = ("--set", "parallel.zero=optim")
BUDDY = (*ZERO1, "--set", "train.buddy_shards=1")


@pytest.mark.timeout(300)
def test_dp2_zero1_with_buddy_shards_killed_in_the_reduction_rejoins_with_the_shards_bitwise(tmp_path, reference,
                                                                                             fault_ranks):
    """ZeRO-1 over the whole dp: the survivor steps the lost rank's shard as its buddy, goes on alone with the
    whole state, and re-shards it over both replicas when the replacement rejoins."""
    _check_fault_run(tmp_path, 2, 1, 2, "reduction", reference, layout=BUDDY, admit_before=4, reference_layout=ZERO1)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank,step,phase,admit_before", [(1, 2, "forward", 4), (2, 3, "optimizer", 0), (0, 2, "backward", 4)])
def test_dp3_zero1_with_buddy_shards_a_replica_killed_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference, fault_ranks, rank, step, phase, admit_before):
    """Two replicas left still hold buddies (the lost shard on the rank before it); the rejoin re-shards over three."""
    _check_fault_run(tmp_path, 3, rank, step, phase, reference, layout=BUDDY, admit_before=admit_before,
                     reference_layout=ZERO1)


ZERO2 = ("--set", "parallel.zero=optim_grads")


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,rank,step,phase,admit_before", [(2, 1, 2, "reduction", 4), (3, 2, 3, "optimizer", 0)])
def test_zero2_with_buddy_shards_a_replica_killed_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference, fault_ranks, dp, rank, step, phase, admit_before):
    """ZeRO-2 with buddies: the gradients all-reduced, each rank keeps its shard and its buddy's of the reduced
    buffer; a survivor steps the lost shard as its buddy, and a rejoin re-shards it (each buddy range bitwise)."""
    _check_fault_run(tmp_path, dp, rank, step, phase, reference, layout=(*ZERO2, "--set", "train.buddy_shards=1"),
                     admit_before=admit_before, reference_layout=ZERO2)


def _check_buddy_resume(tmp_path: Path, layout: tuple) -> None:
    """Two steps with buddy shards under ``layout``, then a resume into a third: each rank's buddy state (dumped by
    the kill harness, which kills no rank here) equals its owner's own, bitwise."""
    import replica_kills

    ft = ("--set", "train.fault_tolerance=replica", "--set", "train.respawn=false")
    res = _run(tmp_path, 2, *ft, "--set", "train.steps=2", layout=layout)
    assert res.exit_code == 0, res.output
    pids = tmp_path / "pids"
    pids.mkdir()
    entry = functools.partial(replica_kills.sigkill_at, 99, 0, "forward", str(pids))  # no rank is killed: the dumps
    with pytest.MonkeyPatch.context() as m:
        m.setattr("pretrain.training.run.run_rank", entry)
        res = _run(tmp_path, 2, *ft, "--set", "train.steps=3", "--set", "checkpoint.resume=true", layout=layout)
    assert res.exit_code == 0, res.output
    assert sorted(_curve(tmp_path / "log")) == [1, 2, 3]
    states = [json.loads((pids / f"state_{r}.json").read_text()) for r in (0, 1)]
    buddies = [json.loads((pids / f"buddy_{r}.json").read_text()) for r in (0, 1)]
    for r in (0, 1):
        assert buddies[r] and buddies[r] == {k: states[1 - r][k] for k in buddies[r]}, r


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_resume_with_buddy_shards_reads_each_buddy_range_from_its_owners_pieces(tmp_path, fault_ranks):
    """A checkpoint holds each ZeRO-1 shard once (its owner's); a resumed rank's buddy range is read from it, so
    the buddy is its owner's state bitwise again (not fresh zeros a later loss would train from)."""
    _check_buddy_resume(tmp_path, BUDDY)


def test_a_generation_over_a_used_store_prefix_is_refused():
    """The planted bug "a new generation reuses the previous store prefix": each member counts itself in its
    generation's prefix, and a count past the generation's members (an earlier generation's) stops the regroup."""
    import torch.distributed as dist

    from pretrain.training.fault_replica import _fresh_prefix

    store = dist.HashStore()
    for _ in range(3):  # generation 1's three members
        _fresh_prefix(store, 1, 3)
    _fresh_prefix(store, 2, 2)  # the next generation: a fresh prefix
    with pytest.raises(RuntimeError, match="was used before"):
        _fresh_prefix(store, 1, 2)  # a two-member generation numbered as the previous one


def test_the_survivors_claim_the_replicas_whose_every_rank_checked_in():
    """Where no launcher publishes a loss, the survivors' event names the whole replicas that checked in: a replica
    with a rank missing is lost whole; nothing when every member checked in (not a loss) or none is left whole."""
    import torch.distributed as dist

    from pretrain.runtime.replica_membership import alive_key, replica_key, survivors_event

    store = dist.HashStore()
    for rank in range(6):  # dp3 x tp2: replica = rank // 2
        store.set(replica_key(rank), str(rank // 2))
    for rank in (0, 1, 3, 4, 5):  # rank 2 died; rank 3, its replica's other rank, still checked in
        store.set(alive_key(1, rank), "1")
    event = survivors_event(store, 1, set(range(6)))
    assert (event["ranks"], event["lost"], event["lost_replica"], event["died"]) == ([0, 1, 4, 5], [2, 3], 1, 2)
    assert event["replicas"] == {"0": 0, "1": 0, "4": 2, "5": 2} and event["lost_by_replica"] == {"1": [2, 3]}
    store.set(alive_key(1, 2), "1")
    assert survivors_event(store, 1, set(range(6))) is None  # everyone alive: the error was not a loss
    assert survivors_event(store, 2, set(range(6))) is None  # no one checked in for generation 2: none left whole


def _resume(ck: Path, root: Path, layout: tuple, steps: int = 6) -> dict[int, tuple[float, float]]:
    """Steps 5.. of a resume from a copy of the checkpoints ``ck`` under ``layout`` (dp, tp), global batch 4."""
    import shutil

    dp, tp = layout
    shutil.copytree(ck, root / "ck")
    res = _run(root, dp, "--set", f"train.steps={steps}", "--set", "checkpoint.resume=true",
               "--set", "train.global_batch=4", tp=tp)
    assert res.exit_code == 0, res.output
    return _curve(root / "log")


@pytest.mark.extended
@pytest.mark.timeout(600)
def test_the_final_checkpoint_of_a_fault_run_resumes_bitwise_and_under_another_layout(tmp_path, reference, fault_ranks):
    """dp2, a replica killed in its forward and its replacement rejoined: the run's final checkpoint is the
    uninterrupted run's, bitwise (each layout resumes both into the same steps, ``==``), at dp2 and under dp1 and
    tp2; and under each the continuation is the uninterrupted run's at the suite's fp32 rule."""
    (tmp_path / "fault").mkdir()
    _check_fault_run(tmp_path / "fault", 2, 1, 2, "forward", reference, admit_before=4)
    uninterrupted = reference.root / "ref2x1-" / "ck"
    assert (uninterrupted / "latest").read_text().strip() == (tmp_path / "fault" / "ck" / "latest").read_text().strip()
    curves = {}
    for layout in ((2, 1), (1, 1), (1, 2)):
        name = f"dp{layout[0]}xtp{layout[1]}"
        curves[layout] = _resume(tmp_path / "fault" / "ck", tmp_path / f"fault-{name}", layout)
        assert sorted(curves[layout]) == [5, 6], curves[layout]
        assert curves[layout] == _resume(uninterrupted, tmp_path / f"uninterrupted-{name}", layout), name
    for layout, curve in curves.items():
        for s, (loss, norm) in curves[(2, 1)].items():
            assert math.isclose(curve[s][0], loss, rel_tol=1e-6) and math.isclose(curve[s][1], norm, rel_tol=1e-6), \
                (layout, s, curve[s], (loss, norm))


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_joiner_with_a_stale_optimizer_step_count_is_caught_by_the_curve(tmp_path, reference, fault_ranks):
    """The planted bug "a joiner with a stale optimizer step count": a replacement that rejoins before step 3 with
    its fresh step count (AdamW's bias correction of its first step, not the third) steps its replica's
    weights differently, and step 4's loss is no longer the uninterrupted run's. Without the bug the
    same run passes, its joiner's count equal to the live replica's (``_check_fault_run``)."""
    (tmp_path / "stale").mkdir(), (tmp_path / "fixed").mkdir()
    with pytest.raises(AssertionError) as caught:
        _check_fault_run(tmp_path / "stale", 2, 1, 2, "forward", reference, admit_before=3, stale_step=True)
    got, expected = _curve(tmp_path / "stale" / "log"), reference(2)
    assert math.isclose(got[3][0], expected[3][0], rel_tol=1e-6), (got, expected)
    assert not math.isclose(got[4][0], expected[4][0], rel_tol=1e-6), (got, expected)
    assert "(4, " in str(caught.value), caught.value  # the curve's check at step 4 failed first
    _check_fault_run(tmp_path / "fixed", 2, 1, 2, "forward", reference, admit_before=3)



@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill,spec,what", [(None, "flip_weight:2:2", "odd_copy"), ((1, 1), "flip_weight:2:3", "persistent")])
def test_a_corrupt_copy_has_its_replica_dropped_and_is_named_by_the_launchers_rank(tmp_path, reference, fault_ranks,
                                                                                  kill, spec, what):
    """dp3, a bit flipped in rank 2's master weight before step 2: its copy is the odd one of three. The copies
    are compared before the step's update, so the two survivors (whose copies agree) redo the step without its
    wrong gradient: the uninterrupted run's curve (fp32, 1e-6) at every step, no replacement started. Or rank 1
    is SIGKILLed first (step 1), which renumbers rank 2 as 1, and the flip before step 3 leaves two copies (no
    majority; no replacement: ``respawn`` off): the loss check finds it persistent; the event names rank 2,
    as the console and ``replica_lost`` do."""
    import replica_kills

    pids = tmp_path / "pids"
    pids.mkdir()
    entry = functools.partial(replica_kills.injected, spec, str(pids)) if kill is None else \
        functools.partial(replica_kills.sigkill_at, *kill, "forward", str(pids), inject=spec)
    with pytest.MonkeyPatch.context() as m:
        m.setattr("pretrain.training.run.run_rank", entry)
        res = _run(tmp_path, 3, "--set", "train.fault_tolerance=replica", "--set", f"train.respawn={str(kill is None).lower()}",
                   "--set", "log.every=1", "--set", "log.integrity_every=1")
    assert res.exit_code == 0, res.output
    log = tmp_path / "log"
    events = [r for r in _records(log) if r.get("event") in ("corruption", "replica_lost", "replica_joined")]
    at = int(spec.rsplit(":", 1)[1])
    assert [(e["event"], e["ranks"]) for e in events if e["event"] != "corruption"] == \
        [("replica_lost", [r]) for r in ([kill[0]] if kill else []) + [2]], events
    bad = events[-1]
    assert (bad["event"], bad["step"], bad["class"], bad["rank"], bad["gpu"]) == ("corruption", at, what, 2, "cpu"), events
    assert bad["host"] and bad["replica_dropped"] and bad["generation_rank"] == (1 if kill else 2), bad
    expected, got = reference(3), _curve(log)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for s, (loss, norm) in expected.items():
        assert math.isclose(got[s][0], loss, rel_tol=1e-6) and math.isclose(got[s][1], norm, rel_tol=1e-6), (s, got[s])
    started = [int(p.name) for p in pids.glob("[0-9]*")]
    assert len(started) == 3 and not [p for p in started if _alive(p)], started  # no replacement, none left
