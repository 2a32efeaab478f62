"""Each replica over two nodes with the store apart: `pretrain store` and two `pretrain train --external-store`
launchers on 127.0.0.1, dp2 x pp2, ``--nproc 2`` (node 0 holds both replicas' first stage, node 1 both second
stages). A rank SIGKILLed on node 0: node 1's launcher SIGKILLs and reaps its half of that replica before the
generation without it exists (the test, a client of the same store, reads that process's state the moment the
generation appears; the survivors claim no loss with a rank still running), each launcher starts its half of the
replacement, which rejoins bitwise, both exit 0 and the curve is the uninterrupted run's (the protocol in-process, a
coordinator other than node 0 too: tests/test_node_fences_external.py). Opt-in: node 0 cut off from the store fences
its ranks (its lease) and exits 1, node 1 goes on."""

import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import test_replica_faults_spanning
from test_replica_faults import _alive, _curve, _records, _run_nodes, reference  # noqa: F401 -- a fixture
from test_replica_faults_nodes import _cut_off_run
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
    errors, _ = _cut_off_run(tmp_path, reference, 0)
    assert errors[0].endswith("stopped its ranks before the other nodes take it as lost"), errors
