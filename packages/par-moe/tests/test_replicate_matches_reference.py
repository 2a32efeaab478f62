"""MoELayer with expert_balance="replicate" at ep 2 and ep 4, under a forced skew (every token's top 4
of 8 experts includes experts 0 and 1, both on EP rank 0: half of all pairs on two experts), gives the
single-device reference's outputs and gradients for two SGD steps, while every EP rank computes at
most ceil(pairs / ep) pairs. The bytes the replica weights fetch and return are the plan's formula.
At ep 4 in two NVLink domains the replicas stay in domain 0, which balances alone: the same checks.
Planted bugs each fail: a replica's gradient not returned, a replica computing with stale weights
(the second step), ranks computing different plans.
"""

import contextlib
import functools
import math

import pytest
import torch
import torch.distributed as dist
from par_groups import CommRecorder

from par_moe import MoEConfig, MoELayer
from par_moe.testing import ReferenceMoE

S, B, H, F, E, TOP_K, LR = 8, 2, 16, 8, 8, 4, 0.01
CONFIGS = {
    "softmax-shared-aux": dict(num_shared_experts=1, aux_loss_coeff=0.01, z_loss_coeff=0.001),
    "sigmoid-scaled": dict(score_func="sigmoid", routed_scaling_factor=2.5, z_loss_coeff=0.001),
}
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def config(name, balance="replicate", dispatcher="alltoall"):
    return MoEConfig(hidden=H, ffn_hidden=F, num_experts=E, top_k=TOP_K, expert_balance=balance, dispatcher=dispatcher,
                     **CONFIGS[name])


def skewed_reference(cfg):
    ref = ReferenceMoE(cfg, seed=7)
    ref.router.expert_bias[:2] = 2.0  # selection only: experts 0 and 1 are in every token's top 4
    return ref


def rank_inputs(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


@contextlib.contextmanager
def planted(bug):
    """Test-only bugs in the replica path; None: none."""
    import par_moe.layer as layer_mod
    import par_moe.replicate as rep
    import par_moe.replicate_gather as gather

    fetch, backward, plan = layer_mod.fetch_replicas, rep._FetchReplicas.backward, rep.plan_replicas
    if bug == "gradient_not_returned":  # the return all-to-all runs, its gradients are dropped
        rep._FetchReplicas.backward = staticmethod(lambda ctx, *g: (*(torch.zeros_like(x) for x in backward(ctx, *g)[:3]),
                                                                    None, None, None, None))
    elif bug == "stale_weights":  # replicas keep the weights of their first fetch (gradients still flow home)
        stale = {}

        def stale_fetch(*args):
            weights = args[:3]
            kept = stale.setdefault("w", [w.detach().clone() for w in weights])
            return fetch(*(s + (w - w.detach()) for s, w in zip(kept, weights)), *args[3:])

        layer_mod.fetch_replicas = stale_fetch
    elif bug == "different_plans":  # each rank plans from its own counts, as if every rank routed alike
        rep.plan_replicas = gather.plan_replicas = lambda counts, *a: plan([counts[dist.get_rank()]] * len(counts), *a)
    elif bug is not None:
        raise ValueError(bug)
    try:
        yield
    finally:
        layer_mod.fetch_replicas, rep._FetchReplicas.backward, rep.plan_replicas = fetch, backward, plan
        gather.plan_replicas = plan


def run_replicated(name, steps=2, bug=None, dispatcher="alltoall", domains=None):
    """Per step: this rank's output, input grad, aux, router and expert grads, the plan's loads and the
    replica bytes recorded (fetch and return); SGD on the expert weights between steps. Under the
    all-gather dispatcher the tokens travel by all-gather and reduce-scatter: its all-to-alls are the
    replica weights' alone."""
    ep_group = dist.new_group(list(range(dist.get_world_size())))
    layer = MoELayer.from_reference(skewed_reference(config(name, dispatcher=dispatcher)), ep_group, aux_group=ep_group)
    layer.set_domains(domains)
    tokens = 0 if dispatcher == "allgather" else 1  # the all-to-alls of the token rows (sent, received) or none
    rank, out = dist.get_rank(), []
    with planted(bug):
        for step in range(steps):
            x, cotangent = rank_inputs(step, rank)
            x.requires_grad_(True)
            with CommRecorder() as forward:
                y, aux = layer(x)
            with CommRecorder() as backward:
                ((y * cotangent).sum() + aux).backward()
            plan, ex = layer.dispatcher.last_plan, layer.experts
            one_expert = sum(getattr(ex, n)[0].numel() * 4 for n in EXPERT_WEIGHTS)
            sent, got = sum(plan.sent(rank, d) for d in range(plan.ep)), sum(plan.sent(s, rank) for s in range(plan.ep))
            fetch = [plan.fetched(rank) * one_expert] if any(plan.replicas) else []
            back = [len(plan.replicas[rank]) * one_expert] if any(plan.replicas) else []
            out.append({"y": y.detach(), "dx": x.grad, "aux": aux.detach(), "router": layer.router.weight.grad.clone(),
                        **{n: getattr(ex, n).grad.clone() for n in EXPERT_WEIGHTS},
                        "before": plan.load_before, "after": plan.load_after,
                        # all-to-all bytes recorded, and the plan's: tokens out, replica weights, outputs back;
                        # backward: output grads, replica grads home, token grads
                        "a2a": ([r.bytes for r in forward.records if r.op == "all_to_all"],
                                [r.bytes for r in backward.records if r.op == "all_to_all"]),
                        "formula": ([sent * H * 4] * tokens + fetch + [got * H * 4] * tokens,
                                    [sent * H * 4] * tokens + back + [got * H * 4] * tokens)})
            with torch.no_grad():
                for n in EXPERT_WEIGHTS:
                    getattr(ex, n).sub_(LR * getattr(ex, n).grad)
            layer.zero_grad()
    return out


@functools.lru_cache(maxsize=None)
def reference_steps(name, ranks, steps=2):
    """The reference over every rank's tokens (concatenated along S), SGD on its expert weights."""
    ref = skewed_reference(config(name, "none"))
    out = []
    for step in range(steps):
        xs, cts = zip(*(rank_inputs(step, r) for r in range(ranks)))
        x = torch.cat(xs).requires_grad_(True)
        y, aux = ref(x)
        ((y * torch.cat(cts)).sum() + aux).backward()
        out.append({"y": y.detach().chunk(ranks), "dx": x.grad.chunk(ranks), "aux": aux.detach(),
                    "router": ref.router.weight.grad.clone(),
                    **{n: getattr(ref.experts, n).grad.clone() for n in EXPERT_WEIGHTS}})
        with torch.no_grad():
            for n in EXPERT_WEIGHTS:
                getattr(ref.experts, n).sub_(LR * getattr(ref.experts, n).grad)
        ref.zero_grad()
    return out


def close(actual, expected, what):
    """fp32 rounding: within 1e-6 of the tensor's largest entry (a sum's order moves its small entries)."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()), msg=lambda m: f"{what}: {m}")


def check(name, per_rank):
    ranks = len(per_rank)
    for step, ref in enumerate(reference_steps(name, ranks)):
        at = f"{name} ep={ranks} step {step}"
        steps = [r[step] for r in per_rank]
        for rank, res in enumerate(steps):
            close(res["y"], ref["y"][rank], f"{at} rank {rank} output")
            close(res["dx"], ref["dx"][rank], f"{at} rank {rank} input grad")
        close(sum(r["aux"] for r in steps), ref["aux"], f"{at} aux loss")
        close(sum(r["router"] for r in steps), ref["router"], f"{at} router grad")
        for n in EXPERT_WEIGHTS:  # each EP rank holds E/ep experts' full gradients (no expert DP here)
            close(torch.cat([r[n] for r in steps]), ref[n], f"{at} expert {n} grad")


@pytest.mark.parametrize("ep,dispatcher", [(2, "alltoall"), (4, "alltoall"), (2, "allgather"), (4, "allgather")])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_replicated_layer_matches_reference_and_balances(dist_run, name, ep, dispatcher):
    per_rank = dist_run(ep, run_replicated, name, dispatcher=dispatcher, timeout=300)
    check(name, per_rank)
    for step in range(2):
        before, after = per_rank[0][step]["before"], per_rank[0][step]["after"]
        cap = math.ceil(sum(before) / ep)
        print(f"{name} {dispatcher} ep={ep} step {step}: pairs per EP rank {list(before)} -> {list(after)} (cap {cap}); "
              f"max/mean {max(before) * ep / sum(before):.3f} -> {max(after) * ep / sum(after):.3f}; "
              f"rank 0 all-to-all bytes {per_rank[0][step]['a2a']}")
        assert max(before) > cap and max(after) <= cap
        for rank, res in enumerate(r[step] for r in per_rank):
            assert (res["before"], res["after"]) == (before, after), f"rank {rank} planned otherwise"
            assert res["a2a"] == res["formula"], f"rank {rank} step {step}: recorded {res['a2a']}, plan {res['formula']}"


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("bug", ["gradient_not_returned", "stale_weights", "different_plans"])
def test_planted_replica_bug_fails(dist_run, bug, dispatcher):
    """Each bug fails the comparison with the reference (or the run itself, where ranks disagree on sizes)."""
    name, ep = "softmax-shared-aux", 4
    try:
        per_rank = dist_run(ep, run_replicated, name, bug=bug, dispatcher=dispatcher, timeout=120)
    except Exception as failure:  # ranks that disagree on the split sizes fail inside the all-to-all
        errors = [line.strip() for line in str(failure).splitlines() if "Error" in line]
        print(f"{bug}: the run failed: {errors[-1:]}")
        assert bug == "different_plans", failure
        return
    with pytest.raises(AssertionError) as caught:
        check(name, per_rank)
    print(f"{bug}: {str(caught.value).splitlines()[0]}")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_replicas_stay_in_their_nvlink_domain_and_match_the_reference(dist_run, dispatcher):
    """ep4 in two domains of two ranks (replicate_across_domains off): experts 0 and 1 (rank 0) replicate onto
    rank 1 only, domain 0 balances to ceil(its pairs / 2), domain 1 computes what it did; the reference's
    outputs and gradients, and the recorded replica bytes are the domain-restricted plan's formula."""
    name, domains = "softmax-shared-aux", (0, 0, 1, 1)
    per_rank = dist_run(4, run_replicated, name, dispatcher=dispatcher, domains=domains, timeout=300)
    check(name, per_rank)
    for step in range(2):
        before, after = per_rank[0][step]["before"], per_rank[0][step]["after"]
        cap = math.ceil(sum(before[:2]) / 2)
        print(f"{dispatcher} step {step}: pairs per EP rank {list(before)} -> {list(after)} (domain 0 cap {cap}); "
              f"rank 0 all-to-all bytes {per_rank[0][step]['a2a']}")
        assert max(before[:2]) > cap and max(after[:2]) <= cap and after[2:] == before[2:]
        assert after[1] > before[1] and max(after) > math.ceil(sum(before) / 4)  # no replica left the domain
        for rank, res in enumerate(r[step] for r in per_rank):
            assert (res["before"], res["after"]) == (before, after), f"rank {rank} planned otherwise"
            assert res["a2a"] == res["formula"], f"rank {rank} step {step}: recorded {res['a2a']}, plan {res['formula']}"
