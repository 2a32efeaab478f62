"""Process-group creation on 8 ranks: an all-reduce over every group proves its membership."""

from datetime import timedelta

import torch
import torch.distributed as dist

from par_groups import RankGrid, create_groups
from par_groups.groups import logical_rank_lists


def all_reduce_every_group(grid_kwargs, placement=None):
    grid = RankGrid(**grid_kwargs)
    pg = create_groups(grid, timeout=timedelta(seconds=30), permutation=placement)
    me = dist.get_rank()
    out = {}
    for name, group in pg.groups.items():
        t = torch.tensor([float(me)])
        dist.all_reduce(t, group=group)
        out[name] = (t.item(), pg.ranks[name], pg.rank_in(name), pg.size(name))
    return out


def expected(grid, placement=None):
    perm = placement or list(range(grid.world_size))
    lists = {n: [[perm[r] for r in g] for g in gs] for n, gs in logical_rank_lists(grid).items()}
    return lists


def _check(results, grid, placement=None):
    lists = expected(grid, placement)
    for rank, res in enumerate(results):
        for name, groups in lists.items():
            mine = next((g for g in groups if rank in g), None)
            if mine is None:
                assert name not in res
                continue
            total, ranks, idx, size = res[name]
            assert total == sum(mine), (rank, name)
            assert list(ranks) == mine and idx == mine.index(rank) and size == len(mine)


def test_every_group_all_reduces_over_exactly_its_members(dist_run):
    kwargs = dict(world_size=8, tp=2, cp=2, pp=2, ep=2, etp=1, hcp=(2, 1))
    _check(dist_run(8, all_reduce_every_group, kwargs), RankGrid(**kwargs))


def test_placement_permutes_the_grid_onto_physical_ranks(dist_run):
    kwargs = dict(world_size=4, tp=2, pp=2)
    placement = [0, 2, 1, 3]
    _check(dist_run(4, all_reduce_every_group, kwargs, placement), RankGrid(**kwargs), placement)


def mesh_groups():
    from par_groups import device_mesh

    mesh = device_mesh(RankGrid(8, tp=2, cp=2, pp=2))
    return {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in mesh.mesh_dim_names}


def test_device_mesh_has_the_grid_groups(dist_run):
    grid = RankGrid(8, tp=2, cp=2, pp=2)
    for rank, dims in enumerate(dist_run(8, mesh_groups)):
        for d in ("tp", "cp", "dp", "pp"):
            assert dims[d] == next(g for g in grid.ranks(d) if rank in g)
