"""A replica over several nodes with the store apart (``--external-store``, `pretrain store`): no launcher hosts the
store, so whichever launcher coordinates (the lowest node not taken as lost) runs node_fences.py's protocol for a node
lost whole, node 0's launcher holds a lease as the others do, and the survivors claim no loss a launcher still has
ranks of to fence. In-process, each "node" a launcher object over one store, real processes as its ranks (the
two-launcher kill run: tests/test_replica_faults_span_external.py)."""

import json
import threading
import time

import pytest
import torch.distributed as dist
from test_node_fences import _fencers, _serving, ranks  # noqa: F401 -- a fixture
from test_replica_faults_nodes import StoreProxy, _free_port

from pretrain.runtime.node_fences import NodeFences
from pretrain.runtime.node_group import BEAT_PREFIX, Heartbeats, NodeGroup
from pretrain.runtime.replica_membership import CLAIM_DEAD, claimable, generation_key


def _external(nnodes: int, node: int, timeout_s: float) -> NodeGroup:
    return NodeGroup(nnodes, node, "127.0.0.1", 1, timeout_s, external=True)


@pytest.mark.parametrize("planted", [False, True], ids=["", "planted-publish-before-the-fence-acks"])
def test_the_store_apart_node_0_lost_whole_node_1_coordinates_and_fences_node_2s_half_before_publishing(
        ranks, monkeypatch, planted):
    """Four launchers of one rank each, the store apart, replica r % 2 (ranks 0, 2 over nodes 0 and 2; 1, 3 over
    nodes 1 and 3). Node 0's beat stops: node 1's launcher (the lowest node left) takes it as lost, has node 2 SIGKILL
    and reap rank 2 and only then publishes ranks 1 and 3; node 2's launcher, watching too, leaves it to node 1. While
    node 0 beat, node 1 did nothing. Planted bug: the coordinator publishes without waiting for the fence's answers."""
    from pretrain.runtime.local_launcher import LocalRanks

    if planted:
        monkeypatch.setattr(NodeFences, "request", lambda self, generation, ranks, procs, replace: None)
    store = dist.HashStore()
    fencers = _fencers(store, 4, 1, lambda r: r % 2)
    launchers = []
    for k in (1, 2):
        launcher = LocalRanks(1, 30, 30, fault_tolerance=True, nodes=_external(4, k, 0.3))
        launcher.store, launcher.fencer, launcher.procs = store, fencers[k], [ranks()]
        launchers.append(launcher)
    node1, node2 = launchers
    for k in range(4):
        store.add(f"{BEAT_PREFIX}{k}", 1)
    stop = threading.Event()
    serving = _serving(fencers[2], node2._local(), stop)
    try:
        for _ in range(3):  # every node beats: nothing lost, node 0 coordinates
            for k in range(4):
                store.add(f"{BEAT_PREFIX}{k}", 1)
            node1._watch_nodes({})
            assert node2.heartbeats.to_publish(store) == [] and not node1.heartbeats.coordinating(store)
            time.sleep(0.15)
        assert not store.check([generation_key(1)])
        for _ in range(400):  # node 0 silent; 1, 2 and 3 go on beating
            if store.check([generation_key(1)]):
                break
            for k in (1, 2, 3):
                store.add(f"{BEAT_PREFIX}{k}", 1)
            assert node2.heartbeats.to_publish(store) == []  # node 2 times node 0 too, and leaves it to node 1
            node1._watch_nodes({})
            time.sleep(0.05)
        assert store.check([generation_key(1)]), "node 1 never took node 0 as lost"
        fenced = node2.procs[0].reaped()  # rank 2 at the moment the generation exists
    finally:
        stop.set()
        serving.join()
    event = json.loads(store.get(generation_key(1)))
    assert (event["ranks"], event["lost"], event["node"]) == ([1, 3], [0, 2], 0), event
    assert node1.heartbeats.coordinating(store) and not node2.heartbeats.coordinating(store)
    assert node2.heartbeats.to_publish(store) == [] and not node2.heartbeats.published
    assert node1.procs[0].exitcode is None and not store.check([generation_key(2)])
    if planted:
        assert not fenced
        return
    assert fenced and fencers[2].nodes.taken == [({2}, False)]


def test_with_node_0s_store_node_0_alone_watches_and_holds_no_lease():
    """node 0's own store: node 0 times the others and beats not (its store ends with it); the store apart: every
    launcher beats, node 0's too, the coordinator times every other one and each other launcher the coordinator
    alone, the next one once it is lost (or done)."""
    store = dist.HashStore()
    hosted = [Heartbeats(NodeGroup(3, k, "127.0.0.1", 1, 30.0)) for k in range(3)]
    apart = [Heartbeats(_external(3, k, 30.0)) for k in range(3)]
    assert [(h.beating, h.watched(store)) for h in hosted] == [(False, [1, 2]), (True, []), (True, [])]
    assert [(h.beating, h.watched(store)) for h in apart] == [(True, [1, 2]), (True, [0]), (True, [0])]
    apart[2].lost.add(0)
    assert apart[2].watched(store) == [1]
    store.set("pretrain/nodes/done/1", "1")
    assert apart[2].watched(store) == [0, 1] and apart[2].coordinating(store)


def test_the_store_apart_node_0_that_cannot_renew_its_heartbeat_calls_its_fence_with_one_line():
    """Node 0's launcher reaches `pretrain store` through a proxy; once the proxy passes nothing, its lease runs out
    and its fence is called with one line (the other nodes take it as lost: node 1 coordinates then)."""
    from pretrain.runtime.node_group import serve_store

    port = _free_port()
    server = serve_store("127.0.0.1", port, 10, "test")
    proxy = StoreProxy(port)
    fenced, lines = threading.Event(), []
    beats = Heartbeats(NodeGroup.parse(2, 0, f"127.0.0.1:{proxy.port}", node_timeout_s=4.0, external=True))
    try:
        beats.start(10, lambda line: (lines.append(line), fenced.set()))
        for _ in range(600):  # beats renewed through the proxy: no fence
            if server.add(f"{BEAT_PREFIX}0", 0) >= 3:
                break
            time.sleep(0.05)
        assert server.add(f"{BEAT_PREFIX}0", 0) >= 3 and not lines, "node 0 does not beat"
        proxy.cut()
        assert fenced.wait(30), "the lease never ran out"
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert lines[0].startswith("node 0 cut off from the job's store at 127.0.0.1:"), lines
        assert lines[0].endswith("stopped its ranks before the other nodes take it as lost"), lines
    finally:
        beats.stop()
        proxy.close()


def test_survivors_claim_under_pretrains_launchers_only_a_loss_whose_every_rank_is_dead():
    """The survivors' own claim (a node lost whole, the store apart): under pretrain's launchers a lost replica with a
    rank still running (a spanning replica's half on a live node) is left to the launcher that fences it; under
    torchrun (each replica on one node, its agent stops the peers) the claim stands."""
    spanning = {"ranks": [1, 3], "lost": [0, 2]}  # rank 0 died with node 0, rank 2 on node 2 still runs
    assert not claimable(spanning, {0}, CLAIM_DEAD)
    assert claimable(spanning, {0, 2}, CLAIM_DEAD) and claimable(spanning, {0}, "1")


def test_torchrun_with_a_replica_over_two_nodes_is_refused_in_one_line_and_launchers_with_the_store_apart_are_not(
        tmp_path, monkeypatch):
    """dp2 x tp2 at one rank per node: under torchrun one line naming the replica, its nodes and the way out; the
    same layout for `pretrain train` launchers with the store apart passes the rule that refused it before (it goes
    on to reach the store, here at a port where none listens)."""
    from one_error_line import assert_one_error_line
    from test_replica_refusals import SMALL, runner

    from pretrain.cli import app
    from pretrain.runtime.rank_env import LAUNCHER_ENV
    from pretrain.runtime.replica_membership import CLAIM_ENV

    layout, flags = ["--set", "parallel.tp=2"], ["--nnodes", "4", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1"]
    monkeypatch.chdir(tmp_path)
    launchers = runner.invoke(app, ["train", "--nproc", "1", *SMALL, *layout, *flags, "--external-store", "--set",
                                    "train.join_timeout_s=0.1", "--set", "log.dir=apart"])
    assert launchers.exit_code == 1 and "timed out" in launchers.output, launchers.output
    assert "on one node" not in launchers.output  # the old refusal's words, exit 2
    worker = {"TORCHELASTIC_RUN_ID": "t", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "RANK": "0",
              "TORCHELASTIC_RESTART_COUNT": "0"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "GROUP_RANK", LAUNCHER_ENV, CLAIM_ENV):  # job_rank_env sets them
        worker[key] = ""
    for key, value in worker.items():  # each restored (or removed) after the test
        monkeypatch.setenv(key, value)
    res = runner.invoke(app, ["train", *SMALL, *layout, *flags, "--set", "log.dir=run"])
    assert_one_error_line(res, "torchrun, a replica over two nodes",
                          "under torchrun with --nnodes 4 needs each data-parallel replica on one node")
    assert "replica 0 spans nodes [0, 1] at 1 workers per torchrun" in res.output
    assert not (tmp_path / "run").exists()
