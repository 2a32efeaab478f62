"""Multi-node fault tolerance past a plain kill: a node cut off from the job's store while its processes live fences
itself (its heartbeat is a lease), and under torchrun a survivor late to notice a loss stays a survivor (the claim
waits for every member still beating). Both as "nodes" on 127.0.0.1 (test_replica_faults.py's harness)."""

import json
import math
import socket
import threading
import time

import pytest
from test_replica_faults import _alive, _check_fault_run, _curve, _records, _run_nodes, reference  # noqa: F401 -- a fixture

NEVER = 99  # a kill step past the run: the harness's stall only


class StoreProxy:
    """A TCP forwarder to the store that the test cuts: after :meth:`cut` it passes no byte either way and connects
    nothing new, but closes no connection (a partition, not a refusal: the cut-off side's calls block)."""

    def __init__(self, port: int) -> None:
        self.upstream, self.cutoff, self.socks = port, threading.Event(), []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accepting, daemon=True).start()

    def _accepting(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.socks.append(client)
            if self.cutoff.is_set():
                continue  # held open, never answered
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.socks.append(server)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pumping, args=(a, b), daemon=True).start()

    def _pumping(self, src, dst) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not self.cutoff.is_set():
                try:
                    dst.sendall(data)
                except OSError:
                    return

    def cut(self) -> None:
        self.cutoff.set()

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


@pytest.mark.extended  # a store process and two launcher processes, each importing torch
@pytest.mark.timeout(300)
def test_a_node_cut_off_from_the_store_fences_its_ranks_and_node_0_goes_on_with_the_uninterrupted_curve(
        tmp_path, reference):
    """Node 1 (its launcher and its rank) reaches `pretrain store` through a proxy; while its rank is held in step 2's
    gradient reduction, the proxy stops passing bytes (its processes live on, their gloo connections too). Node 1's
    launcher cannot renew its heartbeat: within half of ``node_timeout_s`` it SIGKILLs its rank, waits it out and
    exits 1 with one line. Node 0's rank sees the closed connection, claims the loss and goes on alone with the
    uninterrupted curve, every sample once; node 1's rank trained nothing past the cut and no rank is left. Without
    the fence, node 1's rank wakes and trains steps 2 to 4 next to node 0's after node 0 took it as lost."""
    errors, lost = _cut_off_run(tmp_path, reference, 1)
    assert "stopped its ranks before node 0 takes it as lost" in errors[0] and "still running" not in errors[0], errors
    assert [e["step"] for e in lost] == [1], lost


def _cut_off_run(tmp_path, reference, node: int) -> tuple[list[str], list[dict]]:
    """dp2, one replica per node, the store apart: node ``node`` (its launcher and its rank) reaches `pretrain store`
    through a proxy cut while its rank is held in step 2's gradient reduction. It exits 1 with one line naming the
    cut; the other node goes on with the uninterrupted curve, every sample once, and exits 0; the cut node's rank
    trained nothing past step 1 and no rank is left. Returns the cut node's error lines and the loss events."""
    pids = tmp_path / "pids"
    pids.mkdir()
    proxies: list[StoreProxy] = []

    def port_of(k: int, port: int) -> int:
        if k != node:
            return port
        proxies.append(StoreProxy(port))
        return proxies[-1].port

    def cutting() -> None:  # once the node's rank is held in step 2's reduction
        marker = pids / f"stalled_{node}_2_reduction"
        while not marker.exists() and not done.is_set():
            time.sleep(0.05)
        if proxies and marker.exists():
            proxies[0].cut()
            cut_at.append(time.time())

    done, cut_at = threading.Event(), []
    cutter = threading.Thread(target=cutting, daemon=True)
    cutter.start()
    kill = {"args": [node, NEVER, "forward", str(pids)], "kwargs": {"stall": [[node, 2, "reduction", 30.0]]}}
    fault = ("--set", "train.fault_tolerance=replica", "--set", "train.respawn=false", "--set", "log.sample_ids=true",
             "--set", "train.node_timeout_s=6", "--set", "train.join_timeout_s=60")
    try:
        codes, output = _run_nodes(tmp_path, 2, 2, kill, *fault, store="external", port_of=port_of)
    finally:
        done.set()
        cutter.join()
        for p in proxies:
            p.close()
    assert cut_at, output
    mine = output.split("node 1 (exit")[node]
    errors = [line for line in mine.splitlines() if line.startswith("error:")]
    assert codes == [1 if k == node else 0 for k in (0, 1)] and len(errors) == 1, output
    assert errors[0].startswith(f"error: node {node} cut off from the job's store"), output
    log = tmp_path / "log"
    expected, got = reference(2), _curve(log)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4], output
    for s, (loss, norm) in expected.items():
        assert math.isclose(got[s][0], loss, rel_tol=1e-6) and math.isclose(got[s][1], norm, rel_tol=1e-6), s
    lost = [r for r in _records(log) if r.get("event") == "replica_lost"]
    assert [e["ranks"] for e in lost] == [[node]], lost
    records = [json.loads(line) for f in (log / "samples").iterdir() for line in f.read_text().splitlines()]
    for s in range(1, 5):
        latest = max(r["generation"] for r in records if r["step"] == s)
        ids = sorted(i for r in records if r["step"] == s and r["generation"] == latest for i in r["samples"])
        assert ids == list(range((s - 1) * 4, s * 4)), (s, ids)
    # the fenced rank trained nothing past the cut: its last sample record is step 1's
    fenced = [json.loads(line) for line in (log / "samples" / f"rank_{node}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in fenced] == [1], fenced
    left = [int(p.name) for p in pids.glob("[0-9]*") if _alive(int(p.name))]
    assert len(list(pids.glob("[0-9]*"))) == 2 and not left, left
    return errors, lost


@pytest.mark.extended  # a store process, two torchrun agents and their workers, each importing torch
@pytest.mark.timeout(300)
def test_two_torchruns_a_survivor_late_past_the_settling_time_stays_a_survivor_and_is_not_restarted(
        tmp_path, reference):
    """dp2 x tp2 over two torchruns: rank 3 (node 1) SIGKILLed in step 2's forward; rank 1, its replica's other
    rank on node 0, checks in as a survivor 8 s after it noticed the loss (past the 5 s a member once had). Rank 0
    waits for it (its heartbeat still moves) rather than passing over replica 0; the claim keeps both, node 1's agent
    restarts its workers, which rejoin before step 4, and both torchruns exit 0 with the uninterrupted curve: one
    replacement block started, no worker of node 0 restarted."""
    _check_fault_run(tmp_path, 2, 3, 2, "forward", reference, tp=2, admit_before=4, respawn=True, nodes=2,
                     store="torchrun", stall=((1, 2, "claim", 8.0),))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_launcher_that_cannot_renew_its_heartbeat_calls_its_fence_with_one_line():
    """Node 1's heartbeat reaches the store through a proxy; once the proxy passes nothing, the lease runs out and
    the fence is called (from a thread of its own: the beat's own call blocks on the silent connection) with one line
    naming the node and the setting; while the beats go through, it is not."""
    from pretrain.runtime.node_group import NodeGroup, Heartbeats, serve_store

    port = _free_port()
    server = serve_store("127.0.0.1", port, 10, "test")  # noqa: F841 -- held open for the test
    proxy = StoreProxy(port)
    fenced, lines = threading.Event(), []
    beats = Heartbeats(NodeGroup.parse(2, 1, f"127.0.0.1:{proxy.port}", node_timeout_s=4.0))
    try:
        beats.start(10, lambda line: (lines.append(line), fenced.set()))
        while server.add("pretrain/nodes/beat/1", 0) < 3:  # beats renewed through the proxy: no fence
            time.sleep(0.05)
        assert not lines
        proxy.cut()
        assert fenced.wait(30), "the lease never ran out"
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert lines[0].startswith("node 1 cut off from the job's store at 127.0.0.1:") and "node_timeout_s=4" in lines[0]
    finally:
        beats.stop()
        proxy.close()


def test_a_survivor_claiming_a_loss_waits_for_a_member_still_beating(monkeypatch):
    """The claim's watch: a member whose counter moves is never silent however long it has not checked in; one whose
    counter stopped (or never beat) is, once its counter stood still for the quiet time on this survivor's clock."""
    import torch.distributed as dist

    from pretrain.runtime import member_beats
    from pretrain.runtime.member_beats import Silence, beat_key

    clock = [100.0]
    monkeypatch.setattr(member_beats.time, "monotonic", lambda: clock[0])
    store = dist.HashStore()
    store.add(beat_key(1), 1)
    store.add(beat_key(2), 1)
    watch = Silence(store, 5.0)
    assert watch.silent({1, 2, 3}) == set()
    for _ in range(8):  # rank 1 beats each second (a late survivor), rank 2 died, rank 3 never beat
        clock[0] += 1.0
        store.add(beat_key(1), 1)
        quiet = watch.silent({1, 2, 3})
        assert 1 not in quiet
    assert quiet == {2, 3}


def test_node_0_at_the_end_does_not_wait_for_a_node_taken_as_lost(capsys):
    """Node 0 waits at the end for every other node's done mark; a node whose heartbeat stopped (``lost``) never
    marks itself, so it is not waited for; one that neither marks itself nor is lost is named in one line when the
    wait runs out."""
    import torch.distributed as dist

    from pretrain.runtime.node_group import NodeGroup

    store = dist.HashStore()
    NodeGroup(3, 1).finish(store, 0)  # node 1 done
    NodeGroup(3, 0).finish(store, 5.0, lambda: {2})  # node 2 lost: nothing to wait for
    assert capsys.readouterr().err == ""
    NodeGroup(3, 0).finish(store, 0.3, lambda: set())
    assert capsys.readouterr().err.splitlines() == [
        "pretrain: node 0 closes the store: node(s) 2 did not say they finished within 0.3 s"]
