"""Muon's Newton-Schulz owners balance the FLOPs over the data-parallel group at real model shapes.

The rank's model and its DistributedMuon are built as the trainer builds them, on fake tensors in a
fake world (``plan --simulate``'s way: no memory, no values), so the owner assignment is the one a run
of that layout computes. Per sharding group: max / mean Newton-Schulz FLOPs per rank <= 1.1, and the
FLOPs of all ranks add up to every Muon matrix of the model once (an expert's matrix counting as one).
"""

import warnings

import pytest

NS_STEPS = 5
CASES = {  # id: (preset, world, overrides): dp8 and dp64, every rank a data-parallel rank
    "llama3-8b-dp8": ("llama3-8b", 8, ["parallel.tp=1"]),
    "deepseek-v3-dp64": ("deepseek-v3", 64, ["parallel.pp=1", "parallel.ep=1", "parallel.last_stage_layers=0"]),
}


def owners_of(preset: str, world: int, overrides: list[str]):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from par_groups import create_groups, fake_world
    from pretrain.config import load_config
    from pretrain.model.build import build_rank_model

    cfg = load_config(preset, ["train.optimizer=muon", "parallel.zero=optim"] + overrides)
    layout = cfg.validate_world(world)
    with fake_world(0, world), FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fake tensors warn about what they cannot know
        return cfg, build_rank_model(cfg, layout, create_groups(layout.grid)).dp.optimizer.owners


def model_ns_flops(cfg) -> int:
    """Newton-Schulz FLOPs of every Muon matrix of the full model (model/muon_split.py's split), also
    what `pretrain plan` reports."""
    from pretrain.model.muon_split import muon_ns_flops

    assert cfg.train.muon_ns_steps == NS_STEPS
    return muon_ns_flops(cfg.model, NS_STEPS)


@pytest.mark.parametrize("case", list(CASES))
def test_ns_flops_balanced_over_data_parallel_ranks(case):
    preset, world, overrides = CASES[case]
    cfg, owners = owners_of(preset, world, overrides)
    assert [len(o.loads) for o in owners] == [world]  # one sharding group: the whole world
    worst = max(o.imbalance for o in owners)
    print(f"{case}: max/mean Newton-Schulz FLOPs per rank {worst:.5f}")
    assert worst <= 1.1, worst
    assert sum(owners[0].loads) == model_ns_flops(cfg)  # every matrix once
    assert min(owners[0].loads) > 0 and any(owners[0].owned.values())  # every rank owns some; rank 0's list
