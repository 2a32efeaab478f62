"""``[train].compile``: compiled layouts train the single-rank eager model, one graph per kind of block.

Measured compiled against the same run eager (2-layer tiny.toml, 4 steps, 1 and 2 ranks: tp2, cp2,
pp2 zb-v, ZeRO-3, FSDP2, recompute full and selective, tiny-moe ep1 and ep2): inductor's fusions move
the loss by at most 9.5e-8 and the grad norm by at most 6.2e-8 (relative); the layouts below against
the eager single rank: at most 1.4e-7 and 2.5e-7, within the 1e-6 every layout keeps against one
rank (layout_runs), so the compiled layouts keep that tolerance (and its rounding-noise fallback).

Compiling is slow on a small CPU (gcc builds each graph's kernels), so one layout combines the
features rather than test each alone: TP/SP's collectives traced into the graph, the zero-bubble
split backward and full recomputation. Dynamo's counters show no graph break on any rank.
"""

import pytest
import torch

from layout_runs import assert_same, single_rank, train_steps
from layout_runs import deferred_noise as noise

TOLERANCE = 1e-6
COMPILE = "train.compile=true"


def compiled_train_steps(config, overrides, steps_fn=train_steps, *args):
    """``steps_fn`` (:func:`layout_runs.train_steps`) with ``[train].compile`` on, under the watch a
    run has by default (flight records and timing: ``pretrain.training.run``), and dynamo's counters over the
    run: graph breaks and graphs compiled; and the watch's compiled-region entries."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from par_groups.watch import CommWatch

    torch._dynamo.reset()  # the harness's worker processes serve the whole session
    counters.clear()
    with CommWatch(capacity=10_000) as watch:
        result = steps_fn(config, [*overrides, COMPILE], *args)
    regions = sum(e.op.startswith("compiled ") for e in watch.entries)
    return result, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], regions


FOUR_MICROBATCHES = "parallel.microbatches=4"
# name: (config, common overrides, layout, graphs each rank compiles); 4 layers: zb-v's two chunks per rank
LAYOUTS = {
    # one graph serves every block of a rank (and every step): the blocks repeat
    "tp2-pp2-zb-v-recompute-full": (None, (), ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb-v",
                                               "model.recompute=full", FOUR_MICROBATCHES], 1),
    # (a MoE layout, tiny-moe cp2 x ep2 a2a ZeRO-3, also trains the single rank at 1e-6 compiled: 1.39e-7
    # loss, 2.50e-7 grad norm, 2 graphs, 0 breaks; left out of the suite for its 14-35 s. A MoE block
    # compiling its attention only is the unit test below.)
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.timeout(600)  # gcc builds the graph's kernels
def test_compiled_layout_matches_single_rank(dist_run, name):
    config, common, layout, graphs = LAYOUTS[name]
    out = dist_run(4, compiled_train_steps, config, list(common) + layout, timeout=900)
    assert [g for _, _, g, _ in out] == [graphs] * 4  # compiled on every rank, once
    assert [b for _, b, _, _ in out] == [0] * 4  # no graph break: TP's and CP's collectives inside the graph
    assert all(regions > 0 for *_, regions in out)  # the flight recorder still sees every compiled call
    results, reference = [r for r, *_ in out], single_rank(dist_run, config, common)
    assert_same(results, reference, TOLERANCE, name, noise(dist_run, config, common))


@pytest.mark.extended  # the dense layout above proves no graph break with TP's collectives; the MoE block's
@pytest.mark.timeout(600)  # compiled attention alone is the unit test below
def test_compiled_moe_ep2_under_the_watch_has_no_graph_break_and_trains_the_single_rank(dist_run, tmp_path):
    """tiny-moe at tp2 x ep2, compiled (MoE blocks compile their attention), each step from the single
    eager rank's state (moe_stepwise: routing is a discrete top-k)."""
    from moe_stepwise import assert_moe_steps_same, layout_steps, reference_steps

    common = ["model.layers=2", "model.bias_update_rate=0.001"]
    reference = dist_run(1, reference_steps, "tiny-moe", common, str(tmp_path), timeout=600)[0]
    out = dist_run(4, compiled_train_steps, "tiny-moe", common + ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"],
                   layout_steps, str(tmp_path), timeout=900)
    assert [b for _, b, _, _ in out] == [0] * 4, out
    assert all(regions > 0 for *_, regions in out)
    assert_moe_steps_same([r for r, *_ in out], reference, TOLERANCE, "compiled tp2-ep2")


class Block(torch.nn.Module):
    def __init__(self, is_moe: bool = False):
        super().__init__()
        self.is_moe = is_moe
        self.self_attn, self.mlp = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.mlp(self.self_attn(x))


def test_blocks_on_fake_or_meta_tensors_stay_eager_and_moe_blocks_compile_their_attention():
    """`plan --simulate` builds the trainer on fake tensors ("cuda" ones here: no device picked):
    nothing is compiled there, so it measures the eager step. A MoE block compiles its attention."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pretrain.model.compile import compile_blocks_

    with FakeTensorMode():
        with torch.device("cuda"):
            fake = Block()
    with torch.device("meta"):
        meta = Block()
    assert compile_blocks_([fake, meta]) == []
    assert "forward" not in vars(fake) and "forward" not in vars(meta)
    dense, moe = Block(), Block(is_moe=True)
    assert compile_blocks_([dense, moe]) == [dense, moe.self_attn]
    assert "forward" in vars(dense) and "forward" not in vars(moe) and "forward" not in vars(moe.mlp)
