"""Rank assignment on described topologies: hungry groups on NVLink, slow groups across nodes, warnings."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from par_groups import RankGrid, create_groups
from par_groups.topology import Workload, bytes_per_step, evaluate, from_dict, assign_ranks, preset, render_assignment


def nodes_of(topo, ranks):
    return {topo.gpus[r].node for r in ranks}


def assert_contract(p):
    """permutation[i] is the rank of grid position i: the reported groups are the grid's, mapped."""
    perm = p.permutation
    assert sorted(perm) == list(range(p.grid.world_size))
    assert [list(g) for g in p.groups["tp"].ranks] == [[perm[r] for r in g] for g in p.grid.ranks("tp")]


def test_tp8_pp2_on_two_dgx_h100_keeps_tp_in_a_node_and_pp_across():
    topo = preset("dgx-h100", nodes=2)
    p = assign_ranks(RankGrid(16, tp=8, pp=2), topo)
    assert_contract(p)
    assert p.groups["tp"].link == "nvlink" and all(len(nodes_of(topo, g)) == 1 for g in p.groups["tp"].ranks)
    assert p.groups["pp"].link == "network" and all(nodes_of(topo, g) == {0, 1} for g in p.groups["pp"].ranks)
    assert p.warnings == ()


def test_a_bad_given_order_is_replaced():
    topo = preset("dgx-h100", nodes=2)
    grid = RankGrid(16, tp=8, pp=2, order="pp-tp-cp-ep-dp")  # tp strided over both nodes
    assert evaluate(grid, topo).groups["tp"].link == "network"
    p = assign_ranks(grid, topo)
    assert p.groups["tp"].link == "nvlink" and p.given.order == "pp-tp-cp-ep-dp"
    assert p.cost_s < p.given.cost_s


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "cp-ep-dp-pp-tp"])
def test_hierarchical_cp_keeps_the_all_to_all_level_on_nvlink(order):
    topo = preset("dgx-h100", nodes=2)
    p = assign_ranks(RankGrid(16, tp=2, cp=8, hcp=(4, 2), order=order), topo)
    assert_contract(p)
    a2a = p.groups["hcp0"]
    assert a2a.size == 4 and a2a.link == "nvlink" and all(len(nodes_of(topo, g)) == 1 for g in a2a.ranks)
    assert p.groups["tp"].link == "nvlink" and p.groups["hcp1"].link == "network"
    assert p.warnings == ()


def test_ep36_on_nvl72_spans_nine_nodes_on_nvlink():
    topo = preset("nvl72")
    p = assign_ranks(RankGrid(72, ep=36), topo)
    ep = p.groups["ep"]
    assert ep.size == 36 and ep.link == "nvlink"
    assert all(len(nodes_of(topo, g)) == 9 for g in ep.ranks)
    assert p.warnings == ()


def test_hungry_groups_on_nvlink_come_before_cheaper_gradient_traffic():
    # The cost model alone would rather keep the big expert-gradient groups (edp) in a node and
    # send ep across the network; the rule keeps ep, tp and the all-to-all on NVLink first.
    topo = preset("dgx-h100", nodes=8)
    grid = RankGrid(64, tp=4, cp=4, hcp=(2, 2), pp=2, ep=8, etp=1)
    edp_inside = evaluate(RankGrid(64, tp=4, cp=4, hcp=(2, 2), pp=2, ep=8, etp=1, order="tp-cp-dp-ep-pp"), topo)
    p = assign_ranks(grid, topo)
    assert p.cost_s > edp_inside.cost_s and edp_inside.groups["ep"].link == "network"
    assert {p.groups[n].link for n in ("tp", "ep", "hcp0")} == {"nvlink"} and p.warnings == ()


def test_tp16_on_dgx_h100_warns_and_says_how_to_fix():
    p = assign_ranks(RankGrid(16, tp=16), preset("dgx-h100", nodes=2))
    assert p.groups["tp"].link == "network"
    assert len(p.warnings) == 1
    w = p.warnings[0]
    assert w.startswith("tp groups of 16 ranks cross network") and "NVLink domain of 8 GPUs" in w and "--tp 8" in w
    assert "warnings:" in render_assignment(p)


def test_ep_and_cp_all_to_all_too_big_for_a_node_warn():
    topo = preset("dgx-h100", nodes=2)
    ep = assign_ranks(RankGrid(16, ep=16, etp=1), topo)
    assert ep.groups["ep"].link == "network" and any("--ep 8" in w for w in ep.warnings)
    cp = assign_ranks(RankGrid(16, cp=16), topo, Workload(cp_comm="a2a"))
    assert cp.groups["cp"].link == "network" and any("--hcp 8,2" in w for w in cp.warnings)
    ring = assign_ranks(RankGrid(16, cp=16), topo)  # a p2p ring may cross nodes: no warning
    assert ring.warnings == ()


def test_tp_and_a2a_that_do_not_fit_together_warn():
    p = assign_ranks(RankGrid(16, tp=4, cp=4, hcp=(4, 1)), preset("dgx-h100", nodes=2))
    assert p.warnings and "tp x CP all-to-all = 16" in p.warnings[0] and "--hcp 2,2" in p.warnings[0]


def test_pcie_box_keeps_tp_inside_the_node():
    topo = preset("pcie-8gpu", nodes=2)
    p = assign_ranks(RankGrid(16, tp=4, pp=2), topo)
    assert p.groups["tp"].link == "pcie" and p.warnings == ()
    wide = assign_ranks(RankGrid(16, tp=16), topo)
    assert "a node of 8 GPUs (no NVLink)" in wide.warnings[0]


def interleaved(hosts, node_of):
    gpus = [{"node": n, "local": sum(1 for m in node_of[:r] if m == n), "domain": n} for r, n in enumerate(node_of)]
    return from_dict({"hosts": [f"h{i}" for i in range(hosts)], "gpus": gpus,
                      "bandwidth": {"nvlink": 450, "pcie": 64, "network": 50}})


def test_scrambled_launch_needs_an_explicit_permutation():
    # Node 0 holds ranks {0, 7, 8, 15}: no order string makes that a tp group.
    node_of = [0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3, 3, 2, 1, 0]
    topo = interleaved(4, node_of)
    assert evaluate(RankGrid(16, tp=4, pp=4), topo).groups["tp"].link == "network"
    p = assign_ranks(RankGrid(16, tp=4, pp=4), topo)
    assert not p.is_identity
    assert_contract(p)
    assert p.groups["tp"].link == "nvlink" and sorted(map(sorted, p.groups["tp"].ranks))[0] == [0, 7, 8, 15]
    assert "explicit permutation" in render_assignment(p)


def test_cost_model_volumes_match_the_ring_formulas():
    w = Workload(hidden=8, seq_len=16, micro_batch=1, microbatches=3, layers=2, vocab=10, act_bytes=2, grad_bytes=4)
    vol = bytes_per_step(RankGrid(4, tp=2, pp=2), w)
    act = 16 * 8 * 2  # one [S, B, H] activation in bytes
    assert vol["tp"] == 3 * (2 / 2) * 4 * (2 * 1 / 2) * act  # microbatches x layers/stage x 4 all-reduces
    assert vol["pp"] == 2 * 3 * act / 2  # one activation and one gradient per microbatch, SP-sharded
    assert set(vol) == {"tp", "pp"}
    dense = bytes_per_step(RankGrid(2), w)["dp"]
    params = 2 * (4 * 64 + 2 * 8 * 32) + 2 * 10 * 8
    assert dense == 2 * (1 / 2) * params * 4
    a2a = bytes_per_step(RankGrid(4, cp=4), Workload(hidden=8, seq_len=16, microbatches=1, layers=1, cp_comm="a2a"))
    assert a2a["cp"] == 8 * (3 / 4) * (16 // 4) * 8 * 2  # q, k, v, out forward and backward


def groups_with_placement(grid_kwargs, placement):
    grid = RankGrid(**grid_kwargs)
    pg = create_groups(grid, timeout=timedelta(seconds=60), permutation=placement)
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=pg.tp)
    return {"tp": list(pg.ranks["tp"]), "pp": list(pg.ranks["pp"]), "tp_sum": t.item()}


def test_create_groups_accepts_the_placement(dist_run):
    topo = interleaved(2, [0, 1, 1, 0])  # host 0 runs ranks 0 and 3
    p = assign_ranks(RankGrid(4, tp=2, pp=2), topo)
    assert not p.is_identity and p.groups["tp"].link == "nvlink"
    kwargs = dict(world_size=4, tp=2, pp=2, order=p.order)
    results = dist_run(4, groups_with_placement, kwargs, list(p.permutation), timeout=300)  # slow start under load
    for rank, r in enumerate(results):
        assert rank in r["tp"] and len(nodes_of(topo, r["tp"])) == 1
        assert r["tp_sum"] == sum(r["tp"])
        assert len(nodes_of(topo, r["pp"])) == 2
        assert tuple(r["tp"]) in p.groups["tp"].ranks and tuple(r["pp"]) in p.groups["pp"].ranks
