"""Rank grid: Megatron order-string semantics, checked by hand on small layouts and by properties on many."""

import itertools

import pytest

from par_groups import LayoutError, RankGrid

DENSE = ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp"]
EXPERT = ["tp", "ep", "dp", "pp", "tp-ep", "tp-ep-pp"]


def test_world16_default_order_matches_hand_checked_groups():
    g = RankGrid(16, tp=2, cp=2, pp=2)
    assert g.dp == 2
    assert g.ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g.ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.ranks("pp") == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    assert g.ranks("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.embedding_ranks() == g.ranks("pp")


def test_expert_view_refactors_a_stage_as_etp_ep_edp():
    # world 16, tp=2 cp=2 pp=2, experts: etp=1 ep=4 -> edp=2 within each 8-rank stage.
    g = RankGrid(16, tp=2, cp=2, pp=2, ep=4, etp=1)
    assert g.edp == 2
    assert g.expert_ranks("tp") == [[r] for r in range(16)]
    assert g.expert_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert g.expert_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert g.expert_ranks("pp") == g.ranks("pp")
    assert g.coords(6) == {"tp": 0, "cp": 1, "dp": 1, "pp": 0, "etp": 0, "ep": 2, "edp": 1}


def test_tp_outside_dp_order_gives_strided_tp():
    g = RankGrid(8, tp=2, order="dp-tp-pp")
    assert g.ranks("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.ranks("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_hierarchical_cp_levels_nest_inside_each_cp_group():
    g = RankGrid(16, cp=16, hcp=(8, 2))
    inner, outer = g.hcp_ranks()
    assert inner == [list(range(8)), list(range(8, 16))]
    assert outer == [[i, i + 8] for i in range(8)]
    g = RankGrid(16, tp=2, cp=4, hcp=(2, 2))
    inner, outer = g.hcp_ranks()
    assert inner[:2] == [[0, 2], [1, 3]] and [0, 4] in outer


def _layouts():
    for world in (1, 2, 8, 16, 64, 256, 1024):
        for tp, cp, pp, ep, etp in itertools.product((1, 2, 8), (1, 2, 4), (1, 2, 4), (1, 4, 8), (1, 2)):
            if world % (tp * cp * pp) or (world // pp) % (ep * etp):
                continue
            for order in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-dp-cp-ep-pp", "cp-tp-dp-ep-pp"):
                yield world, tp, cp, pp, ep, etp, order


LAYOUTS = list(_layouts())
SAMPLE = LAYOUTS[:: max(1, len(LAYOUTS) // 150)]


def _check_partition(groups, world, size):
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(world))
    assert all(len(g) == size for g in groups)


@pytest.mark.parametrize("world,tp,cp,pp,ep,etp,order", SAMPLE)
def test_every_token_partitions_the_world_and_composites_are_unions(world, tp, cp, pp, ep, etp, order):
    try:
        g = RankGrid(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    except LayoutError as e:
        assert "different pipeline groups" in str(e)  # only orders with pp inside dp are refused
        return
    sizes = {"tp": tp, "cp": cp, "dp": g.dp, "pp": pp}
    esizes = {"tp": etp, "ep": ep, "dp": g.edp, "pp": pp}
    for token in DENSE:
        size = 1
        for t in token.split("-"):
            size *= sizes[t]
        _check_partition(g.ranks(token), world, size)
    for token in EXPERT:
        size = 1
        for t in token.split("-"):
            size *= esizes[t]
        _check_partition(g.expert_ranks(token), world, size)
    # an a-b group is a union of a groups
    for big, small in (("dp-cp", "dp"), ("dp-cp", "cp"), ("tp-dp-cp", "tp-cp"), ("tp-pp", "pp")):
        smalls = g.ranks(small)
        for group in g.ranks(big):
            members = [s for s in smalls if s[0] in group]
            assert sorted(r for s in members for r in s) == sorted(group)
    assert g.ranks("pp") == g.expert_ranks("pp")
    # coordinates agree with group membership
    for r in range(0, world, max(1, world // 7)):
        c = g.coords(r)
        tp_group = next(x for x in g.ranks("tp") if r in x)
        assert tp_group.index(r) == c["tp"]
        ep_group = next(x for x in g.expert_ranks("ep") if r in x)
        assert ep_group.index(r) == c["ep"]


def test_at_least_a_hundred_layouts_checked():
    assert len(SAMPLE) >= 100 and max(l[0] for l in SAMPLE) == 1024


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=10, tp=4), r"world_size=10 is not divisible by tp\*cp\*pp=4\*1\*1=4"),
        (dict(world_size=8, tp=2, order="tp-dp-pp", cp=2), r"lacks cp=2"),
        (dict(world_size=8, ep=3), r"etp\*ep=1\*3=3 does not divide the 8 ranks"),
        (dict(world_size=8, cp=4, hcp=(2, 3)), r"\[2, 3\] multiply to 6, not cp=4"),
        (dict(world_size=8, order="tp-xp-dp"), r"unknown token\(s\) \['xp'\]"),
        (dict(world_size=8, tp=0), r"positive integers"),
    ],
)
def test_bad_layouts_raise_one_clear_error(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        RankGrid(**kwargs)


def test_unknown_group_token_is_rejected():
    g = RankGrid(8, tp=2)
    with pytest.raises(LayoutError, match="unknown dense group 'ep'"):
        g.ranks("ep")
    with pytest.raises(LayoutError, match="unknown expert group 'cp'"):
        g.expert_ranks("cp")
