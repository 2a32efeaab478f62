"""A replica whose ranks lie on several nodes (:mod:`pretrain.runtime.node_fences`): the launcher that sees the loss
publishes the survivors' generation only once every other launcher holding ranks of the replica has SIGKILLed and
reaped them (in-process fencers sharing one store, each "node" a thread, real processes as its ranks; the
two-launcher kill run: tests/test_replica_faults_spanning.py)."""

import json
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from pretrain.runtime.node_fences import NodeFences
from pretrain.runtime.replica_membership import ReplicaFencer, generation_key, replica_key


class _Rank:
    """A stand-in rank process with the ``multiprocessing.Process`` calls a launcher's fence makes."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(["sleep", "60"])
        self.pid = self.popen.pid

    @property
    def exitcode(self):
        return self.popen.poll()

    def join(self, timeout=None) -> None:
        self.popen.wait(timeout)

    def reaped(self) -> bool:
        return not Path(f"/proc/{self.pid}").exists()


def _fencers(store, nodes: int, per_node: int, replica_of) -> list[ReplicaFencer]:
    for r in range(nodes * per_node):
        store.set(replica_key(r), str(replica_of(r)))
    return [ReplicaFencer(store, nodes * per_node, True, per_node, k, node_timeout_s=30) for k in range(nodes)]


def _serving(fencer: ReplicaFencer, procs: dict, stop: threading.Event) -> threading.Thread:
    """A launcher's loop on another node: answer fence requests until told to stop."""
    def loop():
        while not stop.wait(0.01):
            fencer.nodes.serve(procs)
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def ranks():
    made: list[_Rank] = []
    yield lambda: made.append(_Rank()) or made[-1]
    for rank in made:
        rank.popen.kill()
        rank.popen.wait()


@pytest.mark.parametrize("planted", [False, True], ids=["", "planted-another-node-acks-unfenced"])
def test_a_rank_lost_on_node_0_has_its_replicas_rank_on_node_1_fenced_before_the_next_generation(
        ranks, monkeypatch, planted):
    """dp2 x pp2 over two nodes, ranks 0, 1 on node 0 and 2, 3 on node 1, replica r % 2 (each spans both nodes):
    rank 1 dies; node 0 fences nothing else of its own, asks node 1, which SIGKILLs and reaps rank 3 and keeps it to
    start again; the generation published lists ranks 0 and 2. Planted bug: node 1 answers without fencing; its rank
    3 is then still running when the generation exists."""
    if planted:
        monkeypatch.setattr(NodeFences, "fence_asked", lambda self, ranks, procs, generation: None)
    store = dist.HashStore()
    node0, node1 = _fencers(store, 2, 2, lambda r: r % 2)
    procs0, procs1 = {0: ranks(), 1: ranks()}, {2: ranks(), 3: ranks()}
    procs0[1].popen.send_signal(signal.SIGKILL)
    procs0[1].join()
    stop = threading.Event()
    thread = _serving(node1, procs1, stop)
    try:
        assert node0.lost(1, procs0) == {1}
        assert store.check([generation_key(1)])
        fenced = procs1[3].reaped()  # at the moment the generation exists (node 0 published it before returning)
    finally:
        stop.set()
        thread.join()
    event = json.loads(store.get(generation_key(1)))
    assert (event["ranks"], event["lost"], event["lost_replica"]) == ([0, 2], [1, 3], 1), event
    assert procs0[0].exitcode is None and procs1[2].exitcode is None
    if planted:
        assert not fenced
        return
    assert fenced and node1.nodes.taken == [({3}, True)]


def test_a_node_lost_whole_has_its_replicas_ranks_on_the_other_nodes_fenced_and_not_started_again(ranks):
    """Four nodes of one rank each, replica r // 2 (over nodes 0-1 and 2-3): node 3 lost whole; node 0's watch
    asks node 2 to fence rank 2 (not started again: its replica's share on node 3 has no launcher left) and
    publishes the generation with ranks 0 and 1."""
    store = dist.HashStore()
    fencers = _fencers(store, 4, 1, lambda r: r // 2)
    procs = [{0: ranks()}, {1: ranks()}, {2: ranks()}]
    stop = threading.Event()
    threads = [_serving(fencers[k], procs[k], stop) for k in (1, 2)]
    try:
        assert fencers[0].node_lost(3, {3}, procs[0]) == {2, 3}
        fenced = procs[2][2].reaped()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    event = json.loads(store.get(generation_key(1)))
    assert (event["ranks"], event["lost"], event["node"]) == ([0, 1], [2, 3], 3), event
    assert fenced and fencers[2].nodes.taken == [({2}, False)] and not fencers[1].nodes.taken
    assert procs[1][1].exitcode is None


def _in_thread(call) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


def test_a_loss_two_launchers_see_is_published_once_and_the_later_request_spares_the_replacement(ranks):
    """Both ranks of replica 1 die (rank 1 on node 0, rank 3 on node 1): node 0 claims the loss and asks node 1;
    node 1, seeing its own rank die, fences it, publishes nothing and answers without fencing again (a replacement
    it started for rank 3 is not the process that request named). One generation, both ranks lost."""
    from pretrain.runtime.node_fences import request_key

    store = dist.HashStore()
    node0, node1 = _fencers(store, 2, 2, lambda r: r % 2)
    procs0, procs1 = {0: ranks(), 1: ranks()}, {2: ranks(), 3: ranks()}
    for rank in (procs0[1], procs1[3]):
        rank.popen.send_signal(signal.SIGKILL)
        rank.join()
    thread, out = _in_thread(lambda: node0.lost(1, procs0))
    store.wait([request_key(1)])
    assert node1.lost(3, procs1) == {3} and not store.check([generation_key(1)])  # node 0 publishes it
    procs1[3] = ranks()  # its replacement
    node1.nodes.serve(procs1)
    thread.join()
    assert out == [{1}] and procs1[3].exitcode is None and not node1.nodes.taken
    event = json.loads(store.get(generation_key(1)))
    assert (event["ranks"], event["lost"]) == ([0, 2], [1, 3]) and not store.check([generation_key(2)]), event


def test_two_launchers_losing_a_replica_each_at_once_fence_each_others_ranks_and_neither_waits_forever(ranks):
    """dp3 x pp2, stage 0 on node 0 (ranks 0-2), stage 1 on node 1 (ranks 3-5), replica d = ranks d, d + 3: rank 1
    dies on node 0 and rank 5 on node 1 at once; each launcher asks the other while the other waits for its own
    answer, and answers it meanwhile. Two generations: replica 0 is left."""
    store = dist.HashStore()
    node0, node1 = _fencers(store, 2, 3, lambda r: r % 3)
    procs0, procs1 = {r: ranks() for r in range(3)}, {r: ranks() for r in range(3, 6)}
    for rank in (procs0[1], procs1[5]):
        rank.popen.send_signal(signal.SIGKILL)
        rank.join()
    (t0, out0), (t1, out1) = _in_thread(lambda: node0.lost(1, procs0)), _in_thread(lambda: node1.lost(5, procs1))
    t0.join()
    t1.join()
    assert (out0, out1) == ([{1}], [{5}])
    assert (node0.nodes.taken, node1.nodes.taken) == ([({2}, True)], [({4}, True)])
    assert procs0[2].reaped() and procs1[4].reaped() and procs0[0].exitcode is None and procs1[3].exitcode is None
    latest = json.loads(store.get(generation_key(2)))
    assert latest["ranks"] == [0, 3] and not store.check([generation_key(3)]), latest


def test_a_node_that_does_not_fence_its_ranks_in_time_stops_the_run_in_one_line_and_nothing_is_published(ranks):
    """Node 1's launcher never answers (hung, cut off): node 0 publishes no generation beside a rank that may still
    write, and stops once ``node_timeout_s`` passed, naming the node and its ranks."""
    from pretrain.runtime.rank_env import Aborted

    store = dist.HashStore()
    node0, _ = _fencers(store, 2, 2, lambda r: r % 2)
    node0.nodes.timeout_s = 0.2
    procs0 = {0: ranks(), 1: ranks()}
    procs0[1].popen.send_signal(signal.SIGKILL)
    procs0[1].join()
    with pytest.raises(Aborted, match=r"^node 1 did not fence ranks 3 of a lost replica within "
                                      r"\[train\].node_timeout_s=0.2 s: stopped the run rather than go on beside them$"):
        node0.lost(1, procs0)
    assert not store.check([generation_key(1)])
