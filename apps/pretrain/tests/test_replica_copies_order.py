"""Under fault tolerance a lost replica's state needs a live copy elsewhere, and where it lies follows the rank order
(``[parallel].order``) and the permutation placement chooses: an expert-parallel group must lie inside one replica,
and each buddy shard (the rank ``ep x cp`` further in its data-parallel group, in global-rank order) in another. An
order that breaks either is refused in one line up front (test_replica_refusals.py: "ep outside dp", "cp outside
dp, buddies"); a placement that breaks it, in the rank (``replica_copies``, here with a permutation directly, as
placement hands it to the trainer). The default order passes with cp2: its
dense buddies lie ``cp`` ranks on, on the next replica (at stride 1 they were the cp peer, lost with the shard)."""

import pytest
from par_groups.grid import RankGrid
from pretrain.config import load_config
from pretrain.config.fault_rules import replica_copies
from pretrain.errors import UsageError


def _cfg(*overrides):
    return load_config(None, ["train.fault_tolerance=replica", "parallel.zero=optim", "train.buddy_shards=1",
                              *overrides])


def test_buddies_follow_the_placements_permutation():
    cfg = _cfg("parallel.cp=2")
    grid = RankGrid(4, cp=2)  # dp2 x cp2: positions 0, 1 are replica 0 (dp 0), 2, 3 replica 1
    replica_copies(cfg, grid, 2)  # each rank's buddy is 2 ranks on: the other replica
    replica_copies(cfg, grid, 2, permutation=(0, 1, 2, 3))
    with pytest.raises(UsageError, match="rank 0's lies in its own replica"):  # rank 2 now plays dp 0's cp 1
        replica_copies(cfg, grid, 2, permutation=(0, 2, 1, 3))


def test_expert_buddies_and_groups_under_the_default_order_pass():
    cfg = _cfg("parallel.ep=2", "model.num_experts=4")
    replica_copies(cfg, RankGrid(8, ep=2), 8)  # dp8 x ep2: ep groups of 2 consecutive, edp buddies a replica on
    # dp4 x cp2 x ep2: an expert-parallel group is a dp rank's two cp ranks, so a replica (2 dp ranks) holds two
    # expert-dp ranks: an expert buddy lies cp ranks on, a dense one ep x cp
    replica_copies(_cfg("parallel.ep=2", "model.num_experts=4", "parallel.cp=2"), RankGrid(8, cp=2, ep=2), 4)
    with pytest.raises(UsageError, match=r"ranks \[0, 2\] span replicas"):
        replica_copies(cfg, RankGrid(4, ep=2, order="tp-cp-dp-ep-pp"), 4)
