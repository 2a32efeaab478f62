"""The dynamic CP scheduler: capacity never exceeded, short sub-samples stay on one rank, balance."""

import random

import pytest

from par_cp import schedule_subsamples, span_for


def _check_invariants(lengths, cap, ranks):
    sched = schedule_subsamples(lengths, cap, ranks)
    assert [p.index for p in sched.spans] == list(range(len(lengths)))
    for p in sched.spans:
        assert p.length == lengths[p.index]
        assert p.tokens_per_rank * p.span >= p.length
        assert p.tokens_per_rank <= cap
        assert len(p.ranks) == p.span and p.ranks[0] % p.span == 0  # aligned block of ranks
        assert list(p.ranks) == list(range(p.ranks[0], p.ranks[0] + p.span))
        if p.length <= cap:
            assert p.span == 1  # fits one rank: stays on one rank
        else:
            assert p.span > 1 and -(-p.length // (p.span // 2)) > cap  # no more ranks than needed
    for rnd in range(sched.num_rounds):
        assert max(sched.loads(rnd)) <= cap
    return sched


def test_long_samples_spread_short_ones_stay():
    sched = _check_invariants([131072, 2048, 16384, 40000, 1000], 16384, 16)
    spans = [p.span for p in sched.spans]
    assert spans == [8, 1, 1, 4, 1]
    assert sched.num_rounds == 1


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_respect_capacity(seed):
    rng = random.Random(seed)
    ranks = rng.choice([2, 4, 8])
    cap = rng.choice([64, 100, 256])
    lengths = [rng.randint(1, cap * ranks) if rng.random() < 0.2 else rng.randint(1, cap) for _ in range(rng.randint(1, 30))]
    _check_invariants(lengths, cap, ranks)


def test_load_is_balanced_within_the_longest_sample():
    """Greedy longest-first to the least-loaded rank: max load <= mean load + longest sample."""
    rng = random.Random(0)
    lengths = [rng.randint(10, 300) for _ in range(64)]
    sched = _check_invariants(lengths, 10_000, 8)
    assert sched.num_rounds == 1
    loads = sched.loads(0)
    assert max(loads) <= sum(loads) / len(loads) + max(lengths)
    assert max(loads) - min(loads) <= max(lengths)


def test_rejects_what_cannot_fit():
    assert span_for(100, 30) == 4
    with pytest.raises(ValueError, match="needs 8 ranks of 10 tokens, but there are only 4"):
        schedule_subsamples([75], 10, 4)


def test_compute_balance_weighs_long_samples_by_their_quadratic_cost():
    """One long sample and many short ones: balancing tokens piles short ones on the long one's
    rank; balancing attention work keeps them off it."""
    lengths = [300] + [100] * 12
    by_tokens = _check_invariants(lengths, 10_000, 4)
    by_compute = schedule_subsamples(lengths, 10_000, 4, balance="compute")

    def worst(sched):
        work = [0.0] * 4
        for p in sched.spans:
            for r in p.ranks:
                work[r] += p.length * (p.length + 1) / 2 / p.span
        return max(work) / (sum(work) / 4)
    assert worst(by_compute) < worst(by_tokens)
    long_rank = by_compute.spans[0].ranks[0]
    assert all(p.ranks[0] != long_rank for p in by_compute.spans[1:])
