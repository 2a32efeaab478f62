"""``[train].fault_tolerance = "replica"`` with each replica over two nodes (a model-parallel block wider than a
node): two `pretrain train` launchers on 127.0.0.1, dp2 x pp2, ``--nproc 2`` each, so that node 0 holds both
replicas' first stage and node 1 both replicas' second. A rank SIGKILLed on node 0: node 1's launcher fences its
rank of that replica (SIGKILLed and reaped) before node 0's publishes the survivors' generation, each starts its
half of the replacement, which rejoins bitwise; the curve is the uninterrupted run's (the ordering, and a node
answering without fencing, in-process: tests/test_node_fences.py)."""

import json
from pathlib import Path

import pytest
from test_replica_faults import _check_fault_run, _run_nodes, reference  # noqa: F401 -- reference: a fixture

PP2 = ("--set", "parallel.pp=2")


@pytest.mark.extended  # two launcher processes, each importing torch
@pytest.mark.timeout(300)
def test_two_launchers_each_replica_on_both_a_rank_killed_has_its_other_nodes_half_fenced_first_and_rejoins(
        tmp_path, reference, monkeypatch):
    def run_nodes(tmp, *args, **kwargs):
        kill = args[2]
        return _run_nodes(tmp, args[0], args[1], kill | {"kwargs": kill["kwargs"] | {"fence_check": True}}, *args[3:],
                          **kwargs)

    monkeypatch.setitem(_check_fault_run.__globals__, "_run_nodes", run_nodes)
    lost = _check_fault_run(tmp_path, 2, 1, 2, "forward", reference, layout=PP2, admit_before=4, respawn=True, nodes=2)
    assert [e["ranks"] for e in lost] == [[1, 3]], lost  # rank 1 (node 0, stage 0) and rank 3 (node 1, stage 1)
    pids = tmp_path / "pids"
    first = {int(p.name.split("_")[1]): int(p.name.split("_")[2]) for p in pids.glob("rank_*")}
    assert sorted(first) == [0, 1, 2, 3] and not (pids / "killed_3_2").exists()  # rank 3 did not kill itself
    checks = {p.name: json.loads(p.read_text()) for p in pids.glob("fence_*")}
    # each survivor (ranks 0 and 2, one per node), once the generation without replica 1 existed: both of its
    # first processes were gone, rank 3's reaped by node 1's launcher
    assert sorted(checks) == ["fence_0_1", "fence_2_1"], checks
    assert all(sorted(c["checked"]) == sorted([first[1], first[3]]) and c["there"] == [] for c in checks.values()), checks
    assert not Path(f"/proc/{first[3]}").exists()
