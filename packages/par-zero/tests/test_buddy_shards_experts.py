"""buddy_shards=1 with expert parameters (expert parallelism): a replica is an expert-parallel group of consecutive
dp ranks, so the dense buckets' buddy is the shard ``buddy_stride`` ranks on (the next replica's rank at the same
place), and the expert buckets, sharded over the expert-data-parallel group (one rank per replica), take the next
rank of that group. After every step each buddy range (master and AdamW moments) is its owner's own, bitwise."""

import torch
import torch.distributed as dist
from par_zero.testing import OPT, STEPS, tiny_model, train_parallel

from par_groups import comm
from par_zero import data_parallel

BUCKET_MB = 300 / 2**20
EP = 2  # ranks per replica: world 4 is two replicas {0, 1} and {2, 3}; the expert-dp groups {0, 2} and {1, 3}


def _flat(optimizer, ranges, kind: str) -> torch.Tensor:
    return torch.cat([optimizer.range_state(b, kind).float() for b in ranges]) if ranges else torch.zeros(0)


def _owner(group, own: torch.Tensor, step: int) -> torch.Tensor:
    """The own range of the rank ``step`` places on in ``group``."""
    d, me = dist.get_world_size(group), dist.get_rank(group)
    owns = torch.empty(d * own.numel())
    comm.all_gather_into_tensor(owns, own.contiguous(), group)
    return owns.view(d, -1)[(me + step) % d]


def train_expert_buddies(world: int) -> dict:
    rank = dist.get_rank()
    edp = [dist.new_group(list(range(k, world, EP))) for k in range(EP)][rank % EP]
    out = {"dense": [], "expert": []}
    for strategy in ("optim", "optim_grads"):
        dp = data_parallel(tiny_model(expert=True), None, strategy, bucket_mb=BUCKET_MB, expert_dp_group=edp,
                           buddy_shards=1, buddy_stride=EP, **OPT)
        families = {"dense": (None, EP), "expert": (edp, 1)}
        assert {b.groups.buddy_stride for b in dp.buckets} == {EP, 1}
        for step in range(STEPS):
            train_parallel(dp, world, rank, steps=1, start=step)
            for family, (group, stride) in families.items():
                expert = family == "expert"
                own = [b for b in dp.buckets if (b.groups.inner is edp) == expert]
                buddies = [b.buddy for b in own]
                assert own and all(b is not None for b in buddies), family
                for kind in ("master", "exp_avg", "exp_avg_sq"):
                    mine, held = _flat(dp.optimizer, own, kind), _flat(dp.buddy_optimizer, buddies, kind)
                    out[family].append(mine.numel() == held.numel() > 0 and
                                       torch.equal(_owner(group, mine, stride), held))
    return out


def test_expert_and_dense_buddy_shards_mirror_their_owners_on_another_replica_each_step(dist_run):
    """dp4 = two expert-parallel replicas of two: each dense buddy range is the shard of the rank two on (the next
    replica), each expert buddy range the next expert-dp rank's, bitwise after every step, ZeRO-1 and ZeRO-2."""
    for r in dist_run(4, train_expert_buddies, 4, timeout=120):
        assert r["dense"] and all(r["dense"]), r
        assert r["expert"] and all(r["expert"]), r
