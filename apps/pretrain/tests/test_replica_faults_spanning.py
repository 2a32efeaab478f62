"""``[train].fault_tolerance = "replica"`` with each replica over two nodes (a model-parallel block wider than a
node): two `pretrain train` launchers on 127.0.0.1, dp2 x pp2, ``--nproc 2`` each, so that node 0 holds both
replicas' first stage and node 1 both replicas' second. A rank SIGKILLed on node 0: node 1's launcher fences its
rank of that replica (SIGKILLed and reaped) before node 0's publishes the survivors' generation, each starts its
half of the replacement, which rejoins bitwise; the curve is the uninterrupted run's (the ordering, and a node
answering without fencing, in-process: tests/test_node_fences.py). A node lost whole (three launchers, dp3 x pp2):
node 0's watch fences the other nodes' ranks of its replicas, its own and node 1's, and the spanning replica left
goes on."""

import json
import math
import os
from pathlib import Path

import pytest
from test_replica_faults import _alive, _check_fault_run, _curve, _records, _run_nodes, reference  # noqa: F401

PP2 = ("--set", "parallel.pp=2")


@pytest.mark.extended  # two launcher processes, each importing torch
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason="the same kill with the store apart runs in the "
                    "extended tier (test_replica_faults_span_external.py), the same fence protocol; node 0's store's "
                    "ordering in-process (test_node_fences.py); PAR_FULL_MATRIX=1 runs it")
def test_two_launchers_each_replica_on_both_a_rank_killed_has_its_other_nodes_half_fenced_first_and_rejoins(
        tmp_path, reference, monkeypatch):
    _check_spanning_kill(tmp_path, reference, monkeypatch)


def _check_spanning_kill(tmp_path, reference, monkeypatch, store: str = "node0") -> None:
    """Rank 1 (node 0, stage 0) SIGKILLed in step 2's forward, ``store``: whose (:func:`_run_nodes`)."""
    def run_nodes(tmp, *args, **kwargs):
        kill = args[2]
        return _run_nodes(tmp, args[0], args[1], kill | {"kwargs": kill["kwargs"] | {"fence_check": True}}, *args[3:],
                          **kwargs)

    monkeypatch.setitem(_check_fault_run.__globals__, "_run_nodes", run_nodes)
    lost = _check_fault_run(tmp_path, 2, 1, 2, "forward", reference, layout=PP2, admit_before=4, respawn=True, nodes=2,
                            store=store)
    assert [e["ranks"] for e in lost] == [[1, 3]], lost  # rank 1 (node 0, stage 0) and rank 3 (node 1, stage 1)
    pids = tmp_path / "pids"
    first = {int(p.name.split("_")[1]): int(p.name.split("_")[2]) for p in pids.glob("rank_*")}
    assert sorted(first) == [0, 1, 2, 3] and not (pids / "killed_3_2").exists()  # rank 3 did not kill itself
    checks = {p.name: json.loads(p.read_text()) for p in pids.glob("fence_*")}
    # each survivor (ranks 0 and 2, one per node), once the generation without replica 1 existed: both of its
    # first processes were gone, rank 3's reaped by node 1's launcher
    assert sorted(checks) == ["fence_0_1", "fence_2_1"] and not list(pids.glob("unfenced_*")), checks
    assert all(c == {str(first[1]): "gone", str(first[3]): "gone"} for c in checks.values()), checks
    assert not Path(f"/proc/{first[3]}").exists()


@pytest.mark.extended  # three launcher processes, each importing torch
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason="three launchers: the fence on a node's loss is "
                    "proved in-process by test_node_fences.py; PAR_FULL_MATRIX=1 runs it")
def test_three_launchers_node_2_lost_whole_has_its_replicas_ranks_on_nodes_0_and_1_fenced_and_the_curve_goes_on(
        tmp_path, reference):
    """dp3 x pp2, ``--nproc 2`` on three nodes: node 0 holds ranks 0, 1, node 1 ranks 2, 3, node 2 ranks 4, 5; replica
    d is ranks d and d + 3. Node 2 SIGKILLed whole (rank 4 in step 2's forward): at its heartbeat's timeout node 0
    fences rank 1 itself and has node 1 fence rank 2 (replicas 1 and 2 have no whole copy left), then publishes ranks
    0 and 3, which go on with the uninterrupted curve; nodes 0 and 1 exit 0."""
    pids = tmp_path / "pids"
    pids.mkdir()
    kill = {"args": [4, 2, "forward", str(pids)], "kwargs": {"whole_node": True, "fence_check": True}}
    fault = ("--set", "train.fault_tolerance=replica", "--set", "log.sample_ids=true", "--set", "train.node_timeout_s=6")
    codes, output = _run_nodes(tmp_path, 3, 3, kill, *fault, layout=PP2)
    assert codes == [0, 0, -9], output
    expected, got = reference(3, 1, PP2), _curve(tmp_path / "log")
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for s, (loss, norm) in expected.items():
        assert math.isclose(got[s][0], loss, rel_tol=1e-6) and math.isclose(got[s][1], norm, rel_tol=1e-6), (s, got[s])
    lost = [r for r in _records(tmp_path / "log") if r.get("event") == "replica_lost"]
    assert [(e["node"], e["ranks"], e["replicas_left"]) for e in lost] == [(2, [1, 2, 4, 5], 1)], lost
    records = [json.loads(line) for f in (tmp_path / "log" / "samples").iterdir() for line in f.read_text().splitlines()]
    for s in range(1, 5):  # every global sample of every step once: the latest generation's record of a step counts
        latest = max(r["generation"] for r in records if r["step"] == s)
        ids = sorted(i for r in records if r["step"] == s and r["generation"] == latest for i in r["samples"])
        assert ids == list(range((s - 1) * 6, s * 6)), (s, ids)
    first = {int(p.name.split("_")[1]): int(p.name.split("_")[2]) for p in pids.glob("rank_*")}
    checks = {p.name: json.loads(p.read_text()) for p in pids.glob("fence_*")}
    assert sorted(first) == list(range(6)) and sorted(checks) == ["fence_0_1", "fence_3_1"], checks
    assert not list(pids.glob("unfenced_*"))
    # ranks 1 and 2 SIGKILLed and reaped by their launchers; 4 and 5 died with theirs (whoever reaps them, not it)
    assert all(sorted(c) == sorted(str(first[r]) for r in (1, 2, 4, 5)) for c in checks.values()), checks
    assert all(c[str(first[r])] == "gone" for c in checks.values() for r in (1, 2)), checks
    assert all(c[str(first[r])] in ("gone", "Z") for c in checks.values() for r in (4, 5)), checks
    assert not [pid for pid in first.values() if _alive(pid)]
