"""Several `pretrain train` launchers share node 0's store (``--nnodes``, :mod:`pretrain.runtime.node_group`):
node 0 waits for every node's launcher before it closes the store, and a node whose run failed is named by the
others (in-process stores; the two-launcher runs: tests/test_replica_faults.py)."""

import socket

import pytest

from pretrain.runtime.node_group import NodeGroup


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_node_0_hosts_the_store_and_hears_the_others_done_and_failed():
    port = _port()
    first, second = NodeGroup.parse(2, 0, f"127.0.0.1:{port}"), NodeGroup.parse(2, 1, f"127.0.0.1:{port}")
    server, client = first.store(10), second.store(10)
    assert first.other_failure(server) is None and second.other_failure(client) is None
    second.fail(client, "rank 1 failed: exited with code -9 (signal SIGKILL)\nmore")
    assert first.other_failure(server) == "node 1 failed: rank 1 failed: exited with code -9 (signal SIGKILL)"
    assert second.other_failure(client) is None  # its own failure is not another node's
    first.finish(server, 0.0)  # node 1 not done: node 0 gives up when the wait is over
    assert not server.check(["pretrain/nodes/done/1"])
    second.finish(client, 10)
    first.finish(server, 10)  # returns at once: node 1 is done
    assert server.check(["pretrain/nodes/done/1"])


def test_node_0_names_a_node_whose_heartbeat_stopped_once_and_not_one_never_started_or_done(monkeypatch):
    """Node 0 times each node's counter on its own clock: node 1 beats then stops, node 2 never beats (still
    starting), node 3 stopped beating but is done. Only node 1 is lost, once, after ``node_timeout_s``."""
    import torch.distributed as dist

    from pretrain.runtime import node_group
    from pretrain.runtime.node_group import Heartbeats

    clock = [100.0]
    monkeypatch.setattr(node_group.time, "monotonic", lambda: clock[0])
    store = dist.HashStore()
    watch = Heartbeats(NodeGroup(4, 0, node_timeout_s=5.0))
    beats = {k: Heartbeats(NodeGroup(4, k, node_timeout_s=5.0)) for k in (1, 3)}
    for k in (1, 3):
        beats[k].beat(store)
    NodeGroup(4, 3).finish(store, 0)  # node 3's launcher is done
    assert watch.silent(store) == []
    for _ in range(3):  # node 1 beats each second: not lost however long it runs
        clock[0] += 1.0
        beats[1].beat(store)
        assert watch.silent(store) == []
    clock[0] += 5.5
    assert watch.silent(store) == [1]
    clock[0] += 10.0
    assert watch.silent(store) == []  # named once


def test_a_node_lost_before_its_first_beat_is_timed_from_when_its_ranks_joined(monkeypatch):
    """A counter that never moved: node 1's ranks joined, then the node died before it beat (its launcher
    starved, say); node 2 is still starting. Node 1 is lost ``node_timeout_s`` after node 0 first saw it
    started; node 2 is not timed while it has not started, however long that takes."""
    import torch.distributed as dist

    from pretrain.runtime import node_group
    from pretrain.runtime.node_group import Heartbeats

    clock = [100.0]
    monkeypatch.setattr(node_group.time, "monotonic", lambda: clock[0])
    store, started = dist.HashStore(), set()
    watch = Heartbeats(NodeGroup(3, 0, node_timeout_s=5.0))
    for _ in range(10):  # neither has started: never lost
        clock[0] += 1.0
        assert watch.silent(store, started.__contains__) == []
    started.add(1)
    assert watch.silent(store, started.__contains__) == []  # timed from here
    clock[0] += 4.0
    assert watch.silent(store, started.__contains__) == []
    clock[0] += 1.5
    assert watch.silent(store, started.__contains__) == [1]
    clock[0] += 10.0
    assert watch.silent(store, started.__contains__) == []  # named once; node 2 never started


def test_a_node_whose_loss_the_survivors_claimed_first_is_marked_done_when_its_heartbeat_stops(monkeypatch):
    """Node 1 lost whole, its loss claimed by the survivors before node 0's watch names it: no rank of it is left
    in the membership to publish, yet node 0 marks it done, or the end of the run would wait for its mark for
    ``join_timeout_s``."""
    import json

    import torch.distributed as dist

    from pretrain.runtime import node_group
    from pretrain.runtime.local_launcher import LocalRanks
    from pretrain.runtime.node_group import BEAT_PREFIX
    from pretrain.runtime.rank_env import join_key
    from pretrain.runtime.replica_membership import ReplicaFencer, claim, replica_key

    clock = [100.0]
    monkeypatch.setattr(node_group.time, "monotonic", lambda: clock[0])
    ranks = LocalRanks(1, 3600, 10, fault_tolerance=True, nodes=NodeGroup(2, 0, node_timeout_s=5.0))
    ranks.store = store = dist.HashStore()
    ranks.fencer = ReplicaFencer(store, 2)
    for r in (0, 1):
        store.set(replica_key(r), str(r))
        store.set(join_key("joined", r), "1")
    store.add(f"{BEAT_PREFIX}1", 1)
    ranks._watch_nodes()
    assert claim(store, 1, {"ranks": [0], "replicas": {"0": 0}, "lost": [1], "lost_replica": 1})
    clock[0] += 6.0
    ranks._watch_nodes()
    assert store.check(["pretrain/nodes/done/1"]) and json.loads(store.get("pretrain/ft/generation/1"))["ranks"] == [0]


def test_a_launcher_beats_before_its_ranks_start_and_then_from_a_thread():
    """Node 1's first beat is in the store once :meth:`Heartbeats.start` returns (before any of its ranks can
    join), and the counter goes on moving without the launcher's loop; it stops when told."""
    from pretrain.runtime.node_group import BEAT_PREFIX, Heartbeats, serve_store

    port = _port()
    server = serve_store("127.0.0.1", port, 10, "test")
    beats = Heartbeats(NodeGroup.parse(2, 1, f"127.0.0.1:{port}"))
    beats.start(10)
    assert server.add(f"{BEAT_PREFIX}1", 0) == 1
    while server.add(f"{BEAT_PREFIX}1", 0) < 2:  # the thread's beat (bounded by the test's timeout)
        beats.stopped.wait(0.05)
    beats.stop()
    Heartbeats(NodeGroup.parse(2, 0, f"127.0.0.1:{port}")).start(10)  # node 0 beats not (it watches)
    assert not server.check([f"{BEAT_PREFIX}0"])


def test_with_an_external_store_every_node_is_a_client_and_node_0_waits_for_no_one():
    """``--external-store``: the store runs apart (`pretrain store`), node 0 connects to it as node 1 does, so its
    death leaves the store up; node 0's finish returns at once (the store outlives it)."""
    from pretrain.runtime.node_group import serve_store

    port = _port()
    server = serve_store("127.0.0.1", port, 10, "test")
    nodes = [NodeGroup.parse(2, k, f"127.0.0.1:{port}", external=True) for k in (0, 1)]
    clients = [node.store(10) for node in nodes]
    clients[0].set("from-node-0", "1")
    assert clients[1].get("from-node-0") == b"1" and server.get("from-node-0") == b"1"
    nodes[0].finish(clients[0], 60)  # returns at once: nothing waits on node 1
    # (a set is not answered: read back over the same connection, which the store serves in order)
    assert clients[0].check(["pretrain/nodes/done/0"]) and not server.check(["pretrain/nodes/done/1"])
    assert NodeGroup.parse(1, 0, f"127.0.0.1:{port}", external=True).external  # one node: the endpoint still counts


def _torchrun_worker(monkeypatch, world: int, workers: int) -> None:
    """This process as worker 0 of a torchrun whose rendezvous holds ``world`` workers, ``workers`` of them local."""
    for key, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(workers)}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("world,args,words", [
    (2, (), "--rdzv-endpoint None must be HOST:PORT of the job's store (`pretrain store --port PORT`"),
    (4, ("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"), "one torchrun per node (--standalone or --nnodes 1), its "
                                                              "workers one replica group; got WORLD_SIZE=4 over 2")])
def test_replica_fault_tolerance_under_torchrun_needs_the_jobs_store_and_one_torchrun_per_node(
        monkeypatch, tmp_path, world, args, words):
    from typer.testing import CliRunner

    from one_error_line import assert_one_error_line, snapshot
    from pretrain.cli import app

    _torchrun_worker(monkeypatch, world, 2)
    before = snapshot(tmp_path)
    res = CliRunner().invoke(app, ["train", "--set", "train.fault_tolerance=replica", "--set", "train.global_batch=4",
                                   "--set", f"log.dir={tmp_path / 'log'}", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                                   *args])
    assert_one_error_line(res, "torchrun", words)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("args,words", [(("--port", "0"), "--port 0 must be in 1..65535"),
                                        (("--port", "{busy}"), "cannot listen there")])
def test_pretrain_store_refuses_a_port_it_cannot_listen_on_in_one_line(args, words):
    from typer.testing import CliRunner

    from one_error_line import assert_one_error_line
    from pretrain.cli import app
    from pretrain.runtime.node_group import serve_store

    port = _port()
    held = serve_store("127.0.0.1", port, 10, "test")  # the port taken
    res = CliRunner().invoke(app, ["store", "--host", "127.0.0.1", *(a.format(busy=port) for a in args)])
    assert_one_error_line(res, "store", words)
    del held
