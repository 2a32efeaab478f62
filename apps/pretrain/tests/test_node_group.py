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
