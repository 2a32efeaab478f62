"""Several `pretrain train` launchers share node 0's store (``--nnodes``, :mod:`pretrain.runtime.node_group`):
node 0 waits for every node's launcher before it closes the store, and a node whose run failed is named by the
others (in-process stores; the two-launcher runs: tests/test_replica_faults.py)."""

import socket

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
