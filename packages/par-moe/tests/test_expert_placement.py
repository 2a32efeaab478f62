"""The re-placement map (par_moe.placement): greedy packing by load, deterministic, as few moves as it can."""

import random

import pytest

from par_moe import ExpertPlacement, pack_experts


def test_hot_experts_are_spread_and_every_rank_keeps_its_slot_count():
    current = ExpertPlacement.contiguous(8, 4)  # rank r: experts 2r, 2r + 1
    load = [100, 90, 5, 5, 5, 5, 5, 5]  # experts 0 and 1 hot, both on rank 0
    new = pack_experts(load, current)
    ranks = {e: new.position_of[e] // 2 for e in range(8)}
    assert ranks[0] != ranks[1]
    per_rank = [sum(load[e] for e in new.slots(r)) for r in range(4)]
    assert max(per_rank) == 105 and sorted(new.expert_at) == list(range(8))  # 100 + 5: the best any map does
    assert new.expert_at[0] == 0  # expert 0 keeps its rank and its slot
    moves = current.moves_to(new)
    assert all(src != dst or i != j for _, src, i, dst, j in moves)
    assert {e for e, *_ in moves} == {e for e in range(8) if current.position_of[e] != new.position_of[e]}


def test_the_map_is_a_function_of_the_counts_and_stable_when_balanced():
    rng = random.Random(0)
    for _ in range(50):
        ep, local = rng.choice([(2, 4), (4, 2), (8, 4)])
        load = [rng.randrange(1000) for _ in range(ep * local)]
        current = ExpertPlacement(tuple(rng.sample(range(ep * local), ep * local)), local)
        first = pack_experts(load, current)
        assert pack_experts(list(load), current) == first
        # LPT's guarantee: the most loaded rank holds at most the mean plus the largest expert it took
        per_rank = [sum(load[e] for e in first.slots(r)) for r in range(ep)]
        assert max(per_rank) <= sum(load) / ep + max(load)
        assert pack_experts(load, first) == first  # the same counts again: nothing moves
        assert first.moves_to(pack_experts(load, first)) == []


def test_bad_placements_are_refused():
    with pytest.raises(ValueError, match="must be a permutation"):
        ExpertPlacement((0, 0, 1, 2), 2)
    with pytest.raises(ValueError, match="load has 3 experts"):
        pack_experts([1, 2, 3], ExpertPlacement.contiguous(4, 2))


def test_nvlink_domains_keep_moves_inside_them_when_their_loads_are_even():
    """Ranks 0, 2 share a domain, ranks 1, 3 another; each domain holds 220 pairs. Without domains the
    second hot expert of rank 0 crosses to rank 1; with them every move stays in its domain, as balanced."""
    current = ExpertPlacement.contiguous(8, 4)
    load = [100, 100, 10, 10, 10, 10, 100, 100]
    domains = (0, 1, 0, 1)
    rank_load = lambda p: max(sum(load[e] for e in p.slots(r)) for r in range(4))  # noqa: E731
    flat, aware = pack_experts(load, current), pack_experts(load, current, domains)
    assert pack_experts(load, current, (5, 5, 5, 5)) == flat  # one domain: the flat packing
    assert any(domains[src] != domains[dst] for _, src, _, dst, _ in current.moves_to(flat))
    assert aware.moves_to(aware) == [] and current.moves_to(aware)
    assert all(domains[src] == domains[dst] for _, src, _, dst, _ in current.moves_to(aware))
    assert rank_load(aware) == rank_load(flat) == 110


def test_nvlink_domains_swap_experts_when_one_domain_is_hot():
    current = ExpertPlacement.contiguous(8, 4)
    load = [100, 100, 100, 100, 1, 1, 1, 1]  # domain 0 (ranks 0, 1) holds every hot expert
    aware = pack_experts(load, current, (0, 0, 1, 1))
    per_domain = [sum(load[e] for r in rs for e in aware.slots(r)) for rs in ((0, 1), (2, 3))]
    assert per_domain == [202, 202]
    assert max(sum(load[e] for e in aware.slots(r)) for r in range(4)) == 101
