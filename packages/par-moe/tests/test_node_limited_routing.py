"""Node-limited routing (DeepSeek-V3): the router follows the rule, and the all-to-all bytes that
leave a node are bounded by it.

The rule of the paper, for E experts on N nodes (groups of E/N) and top-k within M nodes
(``group_score="top_k_per_group"``): score each node by the sum of its top k/M selection scores
(scores + bias), keep the best M nodes, then the top k experts among theirs. The reference below spells it out per token in plain Python.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from par_groups import CommRecorder, RankGrid, create_groups
from par_moe import MoEConfig, make_dispatcher
from par_moe.router import Router

H, E, K, T = 16, 64, 8, 40


def node_limited_top_k(select: list[float], nodes: int, max_nodes: int, k: int) -> set[int]:
    per_node = len(select) // nodes
    experts_of = [range(n * per_node, (n + 1) * per_node) for n in range(nodes)]
    node_score = [sum(sorted((select[e] for e in experts), reverse=True)[: k // max_nodes]) for experts in experts_of]
    best_nodes = sorted(range(nodes), key=lambda n: -node_score[n])[:max_nodes]
    candidates = [e for n in best_nodes for e in experts_of[n]]
    return set(sorted(candidates, key=lambda e: -select[e])[:k])


def make_router(nodes, max_nodes, score_func="sigmoid"):
    torch.manual_seed(0)
    config = MoEConfig(hidden=H, ffn_hidden=8, num_experts=E, top_k=K, score_func=score_func, n_groups=nodes,
                       topk_groups=max_nodes, routed_scaling_factor=2.5, group_score="top_k_per_group")
    router = Router(config)
    router.expert_bias.copy_(torch.randn(E) * 0.1)
    return router


@pytest.mark.parametrize("nodes,max_nodes,score_func", [(8, 4, "sigmoid"), (4, 1, "sigmoid"), (4, 2, "softmax"), (2, 2, "sigmoid")])
def test_router_follows_the_node_limited_rule(nodes, max_nodes, score_func):
    router = make_router(nodes, max_nodes, score_func)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    routing = router(x)
    select = (routing.scores + router.expert_bias).tolist()
    for t in range(T):
        want = node_limited_top_k(select[t], nodes, max_nodes, K)
        assert set(routing.indices[t].tolist()) == want, t
        chosen = routing.scores[t, routing.indices[t]]  # sigmoid: normalized to sum 1 (DeepSeek-V3), then scaled
        want_weights = 2.5 * (chosen / chosen.sum() if score_func == "sigmoid" else chosen)
        torch.testing.assert_close(routing.weights[t], want_weights, atol=1e-6, rtol=1e-6)


def cross_node_job(limits):
    """ep = 4, one EP rank per node: every byte the dispatch all-to-all sends off-rank leaves the node."""
    pg = create_groups(RankGrid(dist.get_world_size(), ep=4), timeout=timedelta(seconds=60))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(dist.get_rank()))
    sent = {}
    for max_nodes in limits:
        routing = make_router(4, max_nodes)(x)
        with CommRecorder() as rec:
            make_dispatcher("alltoall", E, pg.ep).dispatch(x, routing.indices, routing.weights)
        sent[max_nodes] = rec.records[1].wire_bytes  # records[0]: the counts
    return sent


def test_bytes_leaving_a_node_are_bounded_by_max_route_nodes(dist_run):
    row = (H + 2 * K) * 4  # a token with its k slots' weights and expert ids
    for rank, sent in enumerate(dist_run(4, cross_node_job, (1, 2, 4), timeout=600)):
        for max_nodes in (1, 2):  # each token leaves its node for at most max_nodes others
            assert sent[max_nodes] <= T * max_nodes * row, (rank, max_nodes, sent)
        assert sent[4] > T * 2 * row, (rank, sent)  # unlimited, top-8 of 64 reaches ~3 other nodes
