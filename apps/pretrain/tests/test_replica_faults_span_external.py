"""Each replica over two nodes with the store apart: `pretrain store` and two `pretrain train --external-store`
launchers on 127.0.0.1, dp2 x pp2, ``--nproc 2`` (node 0 holds both replicas' first stage, node 1 both second
stages). A rank SIGKILLed on node 0: node 1's launcher SIGKILLs and reaps its half of that replica before any
survivor sees the generation without it (the survivors claim no loss with a rank still running), each launcher
starts its half of the replacement, which rejoins bitwise, both exit 0 and the curve is the uninterrupted run's
(the protocol in-process, a coordinator other than node 0 too: tests/test_node_fences_external.py)."""

import pytest
from test_replica_faults import reference  # noqa: F401 -- a fixture
from test_replica_faults_spanning import _check_spanning_kill


@pytest.mark.extended  # a store process and two launcher processes, each importing torch
@pytest.mark.timeout(300)
def test_the_store_apart_each_replica_on_both_nodes_a_rank_killed_has_its_other_half_fenced_first_and_rejoins(
        tmp_path, reference, monkeypatch):
    _check_spanning_kill(tmp_path, reference, monkeypatch, store="external")
