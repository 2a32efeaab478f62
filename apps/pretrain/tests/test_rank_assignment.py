"""The trainer places its groups on the topology it finds (pretrain.runtime.rank_assignment).

16 ranks on 2 x DGX-H100 described by the stand-in NVML, one rank at a time in this process on
torch's fake process group: with order pp-tp-cp-ep-dp (tp groups strided across both nodes)
``rank_assignment = "auto"`` builds every tp group inside one node, ``strict`` refuses with the fix.
"""

import pytest
from typer.testing import CliRunner

from pretrain.cli import app
from pretrain.config import load_config
from pretrain.errors import UsageError

WORLD = 16
# tp groups of 4 strided by pp=4 under pp-tp-cp-ep-dp: ranks {0, 4, 8, 12} span both nodes
LAYOUT = ["parallel.tp=4", "parallel.pp=4", "parallel.order=pp-tp-cp-ep-dp", "train.eval_every=0"]


def two_dgx_h100_views():
    """What each of 16 ranks' NVML reports (torchrun numbering: node n holds ranks 8n..8n+7)."""
    from par_groups.topology import local_view
    from par_groups.topology.fake_nvml import dgx_h100_node

    return [local_view(r % 8, nvml=dgx_h100_node(host=r // 8), hostname=f"dgx{r // 8}", env={}) for r in range(WORLD)]


def nvml_topology():
    from pretrain.runtime.rank_assignment import gathered_topology

    return gathered_topology(two_dgx_h100_views())


def build_on_fake_group(cfg, rank, topology):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pretrain.training.train_loop import Trainer

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        t = Trainer(cfg, topology=topology)
        return t.groups.ranks["tp"], t.groups.coords(), t.assignment
    finally:
        dist.destroy_process_group()


def test_stand_in_nvml_describes_two_dgx_h100_nodes():
    topo = nvml_topology()
    assert topo.source == "nvml" and len(topo.nodes) == 2
    assert [g.node for g in topo.gpus] == [0] * 8 + [1] * 8
    assert topo.domain_ranks() == [list(range(8)), list(range(8, 16))]


def test_auto_placement_puts_every_tp_group_inside_one_node():
    cfg = load_config(None, LAYOUT + ["parallel.rank_assignment=auto"])
    topo = nvml_topology()
    results = [build_on_fake_group(cfg, r, topo) for r in range(WORLD)]
    tp_groups = {tuple(tp) for tp, _, _ in results}
    assert len(tp_groups) == WORLD // 4 and sorted(r for g in tp_groups for r in g) == list(range(WORLD))
    for group in tp_groups:
        assert len({topo.gpus[r].node for r in group}) == 1, group
    # each grid coordinate is played by exactly one rank: a permutation, nothing lost or doubled
    coords = {tuple(sorted(c.items())) for _, c, _ in results}
    assert len(coords) == WORLD
    message = results[0][2].message
    assert "instead of pp-tp-cp-ep-dp" in message and "on NVLink: tp" in message, message


def test_the_configured_order_strides_tp_across_nodes():
    """The control: with placement off the same layout's tp groups span both nodes."""
    cfg = load_config(None, LAYOUT + ["parallel.placement=off"])
    topo = nvml_topology()
    tp, _, _ = build_on_fake_group(cfg, 0, topo)
    assert {topo.gpus[r].node for r in tp} == {0, 1}


def test_strict_refuses_naming_the_order_that_fixes_it():
    from pretrain.runtime.rank_assignment import choose_assignment

    cfg = load_config(None, LAYOUT + ["parallel.rank_assignment=strict"])
    with pytest.raises(UsageError, match=r'tp groups of 4 ranks cross network.*Fix: set \[parallel\]\.order = "tp-'):
        choose_assignment(cfg, cfg.validate_world(WORLD), nvml_topology())


def test_strict_cli_exits_2_with_one_line_before_starting_ranks():
    res = CliRunner().invoke(app, ["train", "--nproc", str(WORLD), *sum((["--set", s] for s in LAYOUT), []),
                                   "--set", "parallel.rank_assignment=strict", "--set", "topology.preset=dgx-h100"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank_assignment=strict" in lines[0] and "Fix: set [parallel].order" in lines[0], res.stderr


def test_no_topology_keeps_the_configured_grid():
    from pretrain.runtime.rank_assignment import UNKNOWN, choose_assignment

    cfg = load_config(None, LAYOUT)
    decision = choose_assignment(cfg, cfg.validate_world(WORLD), None)
    assert decision.permutation is None and decision.grid == cfg.validate_world(WORLD).grid
    assert decision.message == UNKNOWN


def test_without_nvml_train_runs_as_before_and_says_topology_unknown_once(tmp_path):
    from par_groups.topology import local_view

    if local_view(0)["gpu"] is not None:
        pytest.skip("this machine has NVML: the topology is known")
    res = CliRunner().invoke(app, ["train", "--nproc", "1", "--set", "train.steps=2", "--set", "train.warmup_steps=1",
                                   "--set", "train.eval_every=0", "--set", f"log.dir={tmp_path}"])
    assert res.exit_code == 0, res.output
    assert res.output.count("topology unknown") == 1, res.output


def test_node_limited_routing_warns_when_an_expert_group_spans_nodes():
    from par_groups import RankGrid
    from par_groups.topology import preset

    from pretrain.runtime.rank_assignment import route_node_spread

    topo = preset("pcie-8gpu", 2)  # ranks 0-7 on node 0, 8-15 on node 1
    grid = RankGrid(WORLD, ep=16)
    assert route_node_spread(4, 2, grid, None, topo) == ""  # groups of 8 EP ranks = the two nodes
    assert route_node_spread(0, 2, grid, None, topo) == ""  # off
    interleaved = tuple((i % 2) * 8 + i // 2 for i in range(WORLD))  # EP ranks alternate between nodes
    warning = route_node_spread(1, 2, grid, interleaved, topo)
    assert "expert group 0 is on ranks [0, 8, 1, 9, 2, 10, 3, 11] of 2 nodes" in warning
    assert route_node_spread(1, 16, grid, interleaved, topo) == ""  # one EP rank per group
