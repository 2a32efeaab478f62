"""``[train].compile``: blocks compiled by inductor train the single-rank eager model, in one graph.

Measured (2-layer tiny.toml, 4 steps, compiled against the same run eager, 1 and 2 ranks: tp2, cp2,
pp2 zb-v, ZeRO-3, FSDP2, recompute full and selective, tiny-moe ep2): inductor's fusions move the
loss by at most 9.5e-8 and the grad norm by at most 6.2e-8 (relative), below the 1e-6 that every
layout keeps against one rank (layout_runs), so the compiled layouts keep that tolerance, with
its rounding-noise fallback.

Compiling is slow on a small CPU (gcc builds each graph's kernels): the few layouts here combine
the features (TP/SP collectives in the graph, the split backward, recomputation; ZeRO-3's hooks,
CP's all-to-all and a MoE block's compiled attention under EP) rather than test each alone.
"""

import pytest
import torch

from layout_runs import assert_close_steps, assert_same, single_rank, train_steps
from layout_runs import deferred_noise as noise
from test_layouts_train_same_model import MOE_BALANCING, assert_moe_same

TOLERANCE = 1e-6
TWO_LAYERS = ("model.layers=2",)
COMPILE = "train.compile=true"


def compiled_train_steps(config, overrides):
    """:func:`layout_runs.train_steps` with ``[train].compile`` on, and dynamo's counters over the
    run: graph breaks and graphs compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # the harness's worker processes serve the whole session
    counters.clear()
    result = train_steps(config, [*overrides, COMPILE])
    return result, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def test_each_block_is_one_graph_and_trains_the_eager_model(dist_run):
    (result, breaks, graphs), = dist_run(1, compiled_train_steps, None, list(TWO_LAYERS), timeout=900)
    assert breaks == 0
    assert graphs == 1  # both blocks (and every step) share one compiled graph: the blocks repeat
    assert_close_steps(result, single_rank(dist_run, None, TWO_LAYERS), TOLERANCE, "compiled",
                       noise(dist_run, None, TWO_LAYERS))


FOUR_MICROBATCHES = "parallel.microbatches=4"
LAYOUTS = {  # name: (config, depth, layout); 4 layers: zb-v's two chunks per rank
    "tp2-pp2-zb-v-recompute-full": (None, (), ["parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb-v",
                                               "model.recompute=full", FOUR_MICROBATCHES]),
    # tiny-moe's dense block and its MoE block's attention compiled; the experts' all-to-all eager
    "moe-cp2-dp2-ep2-a2a-optim_grads_params": ("tiny-moe", MOE_BALANCING + ("train.seed=1234",) + TWO_LAYERS,
                                               ["parallel.cp=2", "parallel.ep=2", "parallel.cp_comm_type=a2a",
                                                "parallel.zero=optim_grads_params"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_single_rank(dist_run, name):
    config, common, layout = LAYOUTS[name]
    out = dist_run(4, compiled_train_steps, config, list(common) + layout, timeout=900)
    assert all(graphs >= 1 for _, _, graphs in out)  # compiled on every rank
    assert all(breaks == 0 for _, breaks, _ in out)  # TP's and CP's all-to-all collectives inside the graph
    results, reference = [r for r, _, _ in out], single_rank(dist_run, config, common)
    if config == "tiny-moe":  # MoE's tolerance (and no rounding-noise measure): see that test file
        assert_moe_same(results, reference, name)
    else:
        assert_same(results, reference, TOLERANCE, name, noise(dist_run, config, common))


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
