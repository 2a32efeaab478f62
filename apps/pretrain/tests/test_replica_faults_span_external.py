"""Each replica over two nodes with the store apart: `pretrain store` and two `pretrain train --external-store`
launchers on 127.0.0.1, dp2 x pp2, ``--nproc 2`` (node 0 holds both replicas' first stage, node 1 both second
stages). A rank SIGKILLed on node 0: node 1's launcher SIGKILLs and reaps its half of that replica before the
generation without it exists (the test, a client of the same store, reads that process's state the moment the
generation appears; the survivors claim no loss with a rank still running), each launcher starts its half of the
replacement, which rejoins bitwise, both exit 0 and the curve is the uninterrupted run's (the protocol in-process, a
coordinator other than node 0 too: tests/test_node_fences_external.py). Opt-in: node 0 cut off from the store fences
its ranks (its lease) and exits 1, node 1 goes on."""

import json
import math
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import test_replica_faults_spanning
from test_replica_faults import _alive, _curve, _records, _run_nodes, reference  # noqa: F401 -- a fixture
from test_replica_faults_nodes import NEVER, StoreProxy
from test_replica_faults_spanning import _check_spanning_kill


def _watching(pids: Path, port: int, seen: dict, done: threading.Event) -> None:
    """Once the first generation is published in the store at ``port``: the state of rank 3's first process then."""
    import torch.distributed as dist

    from pretrain.runtime.replica_membership import generation_key

    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
    while not done.is_set():
        if store.check([generation_key(1)]):
            first = next(pids.glob("rank_3_*"), None)
            try:
                seen["rank 3"] = Path(f"/proc/{first.name.split('_')[2]}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                seen["rank 3"] = "gone"
            except AttributeError:
                seen["rank 3"] = "no pid file"
            return
        time.sleep(0.002)


@pytest.mark.extended  # a store process and two launcher processes, each importing torch
@pytest.mark.timeout(300)
def test_the_store_apart_each_replica_on_both_nodes_a_rank_killed_has_its_other_half_fenced_first_and_rejoins(
        tmp_path, reference, monkeypatch):
    run_nodes, seen, done, watchers = test_replica_faults_spanning._run_nodes, {}, threading.Event(), []

    def watched(tmp, *args, **kwargs):
        def port_of(k: int, port: int) -> int:
            if not watchers:  # the store listens already: `_run_nodes` started it
                watchers.append(threading.Thread(target=_watching, args=(tmp / "pids", port, seen, done), daemon=True))
                watchers[0].start()
            return port
        try:
            return run_nodes(tmp, *args, port_of=port_of, **kwargs)
        finally:
            done.set()
            watchers[0].join()

    monkeypatch.setattr(test_replica_faults_spanning, "_run_nodes", watched)
    _check_spanning_kill(tmp_path, reference, monkeypatch, store="external")
    assert seen == {"rank 3": "gone"}, seen  # SIGKILLed and reaped by node 1's launcher before the generation existed


@pytest.mark.extended  # a store process and two launcher processes, each importing torch
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.environ.get("PAR_FULL_MATRIX"), reason="node 1's cut (test_replica_faults_nodes.py) runs "
                    "the same lease; node 0's lease with the store apart in-process (test_node_fences_external.py); "
                    "PAR_FULL_MATRIX=1 runs it")
def test_the_store_apart_node_0_cut_off_fences_its_ranks_exits_1_in_one_line_and_node_1_goes_on(tmp_path, reference):
    """dp2, one replica per node: node 0 (its launcher and its rank) reaches `pretrain store` through a proxy, cut
    while its rank is held in step 2's gradient reduction. Node 0's launcher fences its rank within half of
    ``node_timeout_s`` and exits 1 with one line; node 1 goes on alone (its rank takes over the log) with the
    uninterrupted curve, every sample once, and exits 0; node 0's rank trained nothing past the cut."""
    pids = tmp_path / "pids"
    pids.mkdir()
    proxies: list[StoreProxy] = []

    def port_of(k: int, port: int) -> int:
        if k:
            return port
        proxies.append(StoreProxy(port))
        return proxies[-1].port

    def cutting() -> None:
        marker = pids / "stalled_0_2_reduction"
        while not marker.exists() and not done.is_set():
            time.sleep(0.05)
        if proxies and marker.exists():
            proxies[0].cut()

    done = threading.Event()
    cutter = threading.Thread(target=cutting, daemon=True)
    cutter.start()
    kill = {"args": [0, NEVER, "forward", str(pids)], "kwargs": {"stall": [[0, 2, "reduction", 30.0]]}}
    fault = ("--set", "train.fault_tolerance=replica", "--set", "train.respawn=false", "--set", "log.sample_ids=true",
             "--set", "train.node_timeout_s=6", "--set", "train.join_timeout_s=60")
    try:
        codes, output = _run_nodes(tmp_path, 2, 2, kill, *fault, store="external", port_of=port_of)
    finally:
        done.set()
        cutter.join()
        for p in proxies:
            p.close()
    node0 = output.split("node 1 (exit")[0]
    errors = [line for line in node0.splitlines() if line.startswith("error:")]
    assert codes == [1, 0] and len(errors) == 1, output
    assert errors[0].startswith("error: node 0 cut off from the job's store") and errors[0].endswith(
        "stopped its ranks before the other nodes take it as lost"), output
    log = tmp_path / "log"
    expected, got = reference(2), _curve(log)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4], output
    for s, (loss, norm) in expected.items():
        assert math.isclose(got[s][0], loss, rel_tol=1e-6) and math.isclose(got[s][1], norm, rel_tol=1e-6), s
    lost = [r for r in _records(log) if r.get("event") == "replica_lost"]
    assert [e["ranks"] for e in lost] == [[0]], lost
    records = [json.loads(line) for f in (log / "samples").iterdir() for line in f.read_text().splitlines()]
    for s in range(1, 5):
        latest = max(r["generation"] for r in records if r["step"] == s)
        ids = sorted(i for r in records if r["step"] == s and r["generation"] == latest for i in r["samples"])
        assert ids == list(range((s - 1) * 4, s * 4)), (s, ids)
    fenced = [json.loads(line) for line in (log / "samples" / "rank_0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in fenced] == [1], fenced
    assert not [int(p.name) for p in pids.glob("[0-9]*") if _alive(int(p.name))]
