"""The replica plan (par_moe.balance) on counts alone: every rank at most ceil(total / ep) pairs, every
pair computed once, the replica bound kept, the same plan from the same counts; and under Zipf(1.2)
routing at ep 4 / 8 / 64, max / mean pairs per EP rank <= 1 + 1 / (pairs per rank), beside today's."""

import math

import pytest
import torch

from par_moe.balance import plan_replicas


def random_counts(gen, ep, experts, low=0, high=50):
    return torch.randint(low, high, (ep, experts), generator=gen).tolist()


def zipf_counts(ep, experts, top_k, tokens, seed, exponent=1.2):
    """Each rank's ``tokens`` tokens pick top_k distinct experts, expert i with weight 1 / (i + 1)^1.2
    (the hottest experts share rank 0: the worst placement); pairs per (rank, expert)."""
    gen = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** exponent
    out = []
    for _ in range(ep):
        chosen = torch.multinomial(probs.expand(tokens, -1), top_k, replacement=False, generator=gen)
        out.append(torch.bincount(chosen.reshape(-1), minlength=experts).tolist())
    return out


def check_plan(counts, num_local, max_replicas):
    """The properties every plan has; returns it."""
    plan = plan_replicas(counts, num_local, max_replicas)
    ep, experts = len(counts), len(counts[0])
    per_expert = [sum(col) for col in zip(*counts)]
    for e, segs in enumerate(plan.segments):  # every pair of every expert computed exactly once
        assert segs[0][0] == e // num_local and all(n >= 0 for _, n in segs)
        assert sum(n for _, n in segs) == per_expert[e]
        assert all(n > 0 and r != e // num_local for r, n in segs[1:]), segs
        assert len({r for r, _ in segs}) == len(segs), f"expert {e} replicated twice on a rank: {segs}"
    for s in range(ep):  # each source's pairs, cut into pieces, are exactly its pairs
        by_expert = [0] * experts
        for r, slot, n in plan.pieces[s]:
            e = r * num_local + slot if slot < num_local else plan.replicas[r][slot - num_local]
            by_expert[e] += n
        assert by_expert == list(counts[s])
    for r in range(ep):  # what a rank receives is what its slots compute, and its load
        assert sum(plan.slot_counts(r)) == plan.load_after[r] == sum(plan.sent(s, r) for s in range(ep))
        assert len(plan.replicas[r]) <= max_replicas
    assert sum(plan.load_after) == sum(plan.load_before) == sum(per_expert)
    assert plan_replicas(counts, num_local, max_replicas) == plan  # deterministic
    return plan


@pytest.mark.parametrize("ep,num_local", [(2, 4), (4, 2), (8, 1), (8, 4)])
def test_plan_caps_every_rank_and_computes_every_pair_once(ep, num_local):
    gen = torch.Generator().manual_seed(ep * 10 + num_local)
    for trial in range(50):
        counts = random_counts(gen, ep, ep * num_local, high=[3, 50, 500][trial % 3])
        if trial % 5 == 0:  # a forced skew: half of all pairs on the first two experts
            counts = [[sum(row) if e < 2 else n for e, n in enumerate(row)] for row in counts]
        plan = check_plan(counts, num_local, max_replicas=ep * num_local)  # unbounded replicas: always balanced
        assert max(plan.load_after) <= math.ceil(sum(plan.load_before) / ep), (counts, plan.load_after)
        check_plan(counts, num_local, max_replicas=1)  # the bound holds (balance may not)


def test_plan_without_pairs_or_skew_replicates_nothing():
    assert not any(plan_replicas([[0] * 8] * 4, 2, 2).replicas)
    assert not any(plan_replicas([[5] * 8] * 4, 2, 2).replicas)


@pytest.mark.parametrize("ep,experts,top_k", [(4, 16, 2), (8, 64, 8), (64, 256, 8)])
def test_zipf_routing_is_balanced_to_one_pair(ep, experts, top_k):
    tokens, bound = 1024, None
    for micro_batch in range(3):
        counts = zipf_counts(ep, experts, top_k, tokens, seed=micro_batch)
        plan = check_plan(counts, experts // ep, max_replicas=2)
        mean = sum(plan.load_before) / ep  # pairs (token slots) per EP rank
        bound = 1 + 1 / mean
        before, after = plan.max_over_mean(plan.load_before), plan.max_over_mean(plan.load_after)
        print(f"Zipf(1.2) ep={ep} E={experts} top{top_k} micro-batch {micro_batch}: max/mean {before:.3f} today, "
              f"{after:.6f} balanced (bound {bound:.6f}); {sum(map(len, plan.replicas))} replicas, "
              f"at most {max(map(len, plan.replicas))} per rank")
        assert before > 1.5  # the skew is real
        assert after <= bound
