"""The strategy name, parsed once into what it shards, and the wrapper each strategy gets."""

import pytest
from torch import nn

from par_zero import DataParallel, DataParallelConfig

SHARDS = {  # strategy: (optimizer state, grads, params) sharded
    "no_shard": (False, False, False),
    "optim": (True, False, False),
    "optim_grads": (True, True, False),
    "optim_grads_params": (True, True, True),
    "torch_fsdp2": (True, True, True),
}


@pytest.mark.parametrize("strategy", SHARDS)
def test_strategy_booleans(strategy):
    cfg = DataParallelConfig(strategy)
    assert (cfg.shard_optimizer, cfg.shard_grads, cfg.shard_params) == SHARDS[strategy]
    assert cfg.torch_native == (strategy == "torch_fsdp2")
    assert not cfg.outer_shard_optimizer and DataParallelConfig(strategy, "optim").outer_shard_optimizer


def test_outer_optim_needs_our_zero3():
    DataParallelConfig("optim_grads_params", "optim").check_outer(True)
    for strategy in ("optim", "optim_grads", "torch_fsdp2"):
        with pytest.raises(ValueError, match="outer_strategy='optim' is only valid with strategy='optim_grads_params'"):
            DataParallelConfig(strategy, "optim").check_outer(True)
    with pytest.raises(ValueError, match="needs a sharded inner strategy"):
        DataParallelConfig("no_shard").check_outer(True)


def test_data_parallel_class_points_torch_fsdp2_to_the_factory():
    with pytest.raises(ValueError, match=r"par_zero.data_parallel\(...\)"):
        DataParallel(nn.Linear(2, 2), None, "torch_fsdp2")
