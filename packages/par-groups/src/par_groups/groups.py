"""Process groups for a rank grid, created in one call and held in an immutable object.

No module-level state: the returned :class:`ParallelGroups` is passed explicitly to every
parallel module. Every rank must make the same call, since torch creates groups collectively.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .grid import LayoutError, RankGrid

# name -> (view, token) for every group a rank belongs to.
GROUP_TOKENS: dict[str, tuple[str, str]] = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "dp": ("dense", "dp"),
    "dp_cp": ("dense", "dp-cp"),
    "pp": ("dense", "pp"),
    "tp_pp": ("dense", "tp-pp"),
    "tp_cp": ("dense", "tp-cp"),
    "tp_dp_cp": ("dense", "tp-dp-cp"),
    "embedding": ("embedding", ""),
    "ep": ("expert", "ep"),
    "etp": ("expert", "tp"),
    "edp": ("expert", "dp"),
    "tp_ep": ("expert", "tp-ep"),
    "tp_ep_pp": ("expert", "tp-ep-pp"),
}


def logical_rank_lists(grid: RankGrid) -> dict[str, list[list[int]]]:
    """Rank lists of every named group, in grid (logical) ranks."""
    out = {}
    for name, (view, token) in GROUP_TOKENS.items():
        if view == "dense":
            out[name] = grid.ranks(token)
        elif view == "expert":
            out[name] = grid.expert_ranks(token)
        else:
            out[name] = grid.embedding_ranks()
    for level, groups in enumerate(grid.hcp_ranks()):
        out[f"hcp{level}"] = groups
    return out


@dataclass(frozen=True)
class ParallelGroups:
    """All process groups one rank belongs to, with its rank and the size of each.

    Names: tp, cp, dp, dp_cp, pp, tp_pp, tp_cp, tp_dp_cp, embedding, ep, etp (expert TP),
    edp (expert DP), tp_ep, tp_ep_pp, and hcp0, hcp1, ... for hierarchical CP levels
    (also as the tuple ``hcp``). ``ranks[name]`` lists the global ranks of this rank's group.
    """

    grid: RankGrid
    rank: int
    groups: dict[str, ProcessGroup] = field(repr=False)
    ranks: dict[str, tuple[int, ...]]
    permutation: tuple[int, ...] | None = None  # permutation[i] = global rank of grid position i; None = identity

    def __getattr__(self, name: str) -> ProcessGroup:
        groups = self.__dict__.get("groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(f"no process group {name!r}; have {sorted(groups)}")

    @property
    def hcp(self) -> tuple[ProcessGroup, ...]:
        return tuple(self.groups[f"hcp{i}"] for i in range(len(self.grid.hcp or ())))

    @property
    def position(self) -> int:
        """This rank's grid position (its rank when the permutation is the identity)."""
        return self.rank if self.permutation is None else self.permutation.index(self.rank)

    def coords(self) -> dict[str, int]:
        """This rank's logical grid coordinates (tp, cp, dp, pp, etp, ep, edp), whatever the permutation."""
        return self.grid.coords(self.position)

    def physical(self, logical: list[list[int]]) -> list[list[int]]:
        """Grid-position rank lists (e.g. ``grid.ranks("dp-cp")``) as global ranks under the permutation."""
        return [list(g) if self.permutation is None else [self.permutation[r] for r in g] for g in logical]

    def size(self, name: str) -> int:
        return len(self.ranks[name])

    def rank_in(self, name: str) -> int:
        return self.ranks[name].index(self.rank)


def create_groups(
    grid: RankGrid,
    timeout: timedelta | None = None,
    permutation: Sequence[int] | None = None,
    backend: str | None = None,
) -> ParallelGroups:
    """Create every group of ``grid`` on the current default process group; call on every rank.

    ``permutation[i]`` is the global rank that plays grid position ``i`` (from par_groups'
    topology placement); the identity when omitted. ``timeout`` is passed to every group.
    Groups with identical membership share one ProcessGroup.
    """
    if not dist.is_initialized():
        raise RuntimeError("create_groups needs torch.distributed initialized (init_process_group) first")
    world = dist.get_world_size()
    if world != grid.world_size:
        raise LayoutError(f"grid is for world_size={grid.world_size} but the process group has {world} ranks")
    perm = list(range(world)) if permutation is None else [int(r) for r in permutation]
    if sorted(perm) != list(range(world)):
        raise LayoutError(f"permutation must be a permutation of 0..{world - 1}, got {perm}")
    me = dist.get_rank()
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if backend is not None:
        kwargs["backend"] = backend
    made: dict[tuple[tuple[int, ...], ...], ProcessGroup] = {}
    groups: dict[str, ProcessGroup] = {}
    ranks: dict[str, tuple[int, ...]] = {}
    for name, logical in logical_rank_lists(grid).items():
        physical = tuple(tuple(perm[r] for r in g) for g in logical)
        if physical not in made:
            # Every rank enumerates every group in the same order, as torch requires.
            mine, _ = dist.new_subgroups_by_enumeration([list(g) for g in physical], **kwargs)
            made[physical] = mine
        mine_ranks = next((g for g in physical if me in g), None)
        if mine_ranks is not None:  # middle pipeline stages are in no embedding group
            groups[name] = made[physical]
            ranks[name] = mine_ranks
    return ParallelGroups(grid=grid, rank=me, groups=groups, ranks=ranks,
                          permutation=None if permutation is None else tuple(perm))


def device_mesh(grid: RankGrid, device_type: str = "cpu", view: str = "dense"):
    """The grid as a torch DeviceMesh (slowest dimension first), for code that wants DTensor.

    The dense view has dimensions ("pp", "dp", "cp", "tp") in the order string's reverse; the
    expert view ("pp", "edp", "ep", "etp"). Size-1 dimensions are kept so names are stable.
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    view_obj = grid._dense if view == "dense" else grid._expert
    rename = {"dense": {}, "expert": {"tp": "etp", "dp": "edp"}}[view]
    keep = [(n, s) for n, s in zip(view_obj.names, view_obj.sizes) if not (view == "dense" and n == "ep") and not (view == "expert" and n == "cp")]
    names = [rename.get(n, n) for n, _ in reversed(keep)]
    sizes = [s for _, s in reversed(keep)]
    mesh = torch.arange(grid.world_size).reshape(sizes)
    return DeviceMesh(device_type, mesh, mesh_dim_names=tuple(names))
