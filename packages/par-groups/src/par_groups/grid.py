"""The rank grid: which ranks form each parallel group, in Megatron-LM's order-string convention.

Ranks form a mixed-radix grid. In the order string ``tp-cp-ep-dp-pp`` the leftmost dimension
varies fastest (adjacent ranks), the rightmost slowest. Two views share the same ranks:

* the dense view factors the world as tp x cp x dp x pp (ep is excluded: size 1),
* the expert view factors it as etp x ep x edp x pp (cp is excluded: size 1),

and both must give identical pp groups. Pure Python: no process group is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .dims import ParallelDims

DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
DENSE_TOKENS = ("tp", "cp", "dp", "pp")
EXPERT_TOKENS = ("tp", "ep", "dp", "pp")


class LayoutError(ValueError):
    """A parallel layout that cannot be laid out on the world; the message names the numbers."""


def _prefix_product(sizes: list[int]) -> list[int]:
    out = [1]
    for s in sizes:
        out.append(out[-1] * s)
    return out


def _decompose(index: int, shape: list[int]) -> list[int]:
    """Mixed-radix digits of ``index``, least significant (fastest) first."""
    return [(index // stride) % size for size, stride in zip(shape, _prefix_product(shape))]


def orthogonal_groups(sizes: list[int], mask: list[bool]) -> list[list[int]]:
    """Groups of ranks that differ only in the masked dimensions of a grid of ``sizes``.

    Dimension 0 is the fastest varying. Groups are listed in order of their smallest rank;
    inside a group, ranks go in grid order of the masked dimensions (Megatron's convention).
    """
    strides = _prefix_product(sizes)[:-1]
    in_shape = [s for s, m in zip(sizes, mask) if m]
    in_stride = [d for d, m in zip(strides, mask) if m]
    out_shape = [s for s, m in zip(sizes, mask) if not m]
    out_stride = [d for d, m in zip(strides, mask) if not m]
    group_size = math.prod(in_shape)
    groups = []
    for g in range(math.prod(sizes) // group_size):
        base = sum(i * d for i, d in zip(_decompose(g, out_shape), out_stride))
        groups.append(
            [base + sum(i * d for i, d in zip(_decompose(r, in_shape), in_stride)) for r in range(group_size)]
        )
    return groups


def parse_order(order: str) -> list[str]:
    tokens = [t.strip().lower() for t in order.split("-")]
    unknown = [t for t in tokens if t not in DIMENSIONS]
    if unknown:
        raise LayoutError(f"order {order!r} has unknown token(s) {unknown}; use a hyphen-joined order of {'/'.join(DIMENSIONS)}")
    dupes = sorted({t for t in tokens if tokens.count(t) > 1})
    if dupes:
        raise LayoutError(f"order {order!r} repeats {dupes}; each dimension may appear once")
    return tokens


@dataclass(frozen=True)
class _View:
    """One factorization of the world: dimension sizes in order-string order."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def ranks(self, token: str, valid: tuple[str, ...], view: str) -> list[list[int]]:
        parts = [t.strip().lower() for t in token.split("-")]
        bad = [t for t in parts if t not in valid]
        if bad or len(set(parts)) != len(parts):
            raise LayoutError(
                f"unknown {view} group {token!r}; use hyphen-joined tokens from {', '.join(valid)} (each once)"
            )
        mask = [n in parts for n in self.names]
        return orthogonal_groups(list(self.sizes), mask)

    def coords(self, rank: int) -> dict[str, int]:
        return dict(zip(self.names, _decompose(rank, list(self.sizes))))


@dataclass(frozen=True)
class RankGrid(ParallelDims):
    """A parallel layout of ``world_size`` ranks (its degrees: :class:`ParallelDims`, which derives dp
    and expert dp), in a Megatron ``order``.

    >>> g = RankGrid(16, tp=2, cp=2, pp=2)
    >>> g.ranks("tp")[:2], g.ranks("pp")[:2]
    ([[0, 1], [2, 3]], [[0, 8], [1, 9]])
    """

    order: str = "tp-cp-ep-dp-pp"
    hcp: tuple[int, ...] | None = None
    _dense: _View = field(init=False, repr=False, compare=False)
    _expert: _View = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.hcp is not None:
            object.__setattr__(self, "hcp", tuple(int(s) for s in self.hcp))
        sizes = {"world_size": self.world_size, "tp": self.tp, "cp": self.cp, "pp": self.pp, "ep": self.ep, "etp": self.etp}
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise LayoutError(f"sizes must be positive integers, got {bad}")
        model = self.tp * self.cp * self.pp
        if self.world_size % model:
            raise LayoutError(
                f"world_size={self.world_size} is not divisible by tp*cp*pp={self.tp}*{self.cp}*{self.pp}={model}"
            )
        stage = self.world_size // self.pp
        if stage % (self.etp * self.ep):
            raise LayoutError(
                f"etp*ep={self.etp}*{self.ep}={self.etp * self.ep} does not divide the {stage} ranks of a pipeline stage "
                f"(world_size={self.world_size} / pp={self.pp})"
            )
        tokens = parse_order(self.order)
        dims = {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp, "pp": self.pp, "etp": self.etp, "edp": self.edp}
        missing = [f"{t}={dims[t]}" for t in ("tp", "cp", "ep", "dp", "pp") if t not in tokens and dims[t] > 1]
        if missing:
            raise LayoutError(f"order {self.order!r} lacks {', '.join(missing)}; every dimension larger than 1 must be named")
        tokens += [t for t in DIMENSIONS if t not in tokens]
        dense = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        expert = {"tp": self.etp, "cp": 1, "ep": self.ep, "dp": self.edp, "pp": self.pp}
        object.__setattr__(self, "_dense", _View(tuple(tokens), tuple(dense[t] for t in tokens)))
        object.__setattr__(self, "_expert", _View(tuple(tokens), tuple(expert[t] for t in tokens)))
        if self.ranks("pp") != self.expert_ranks("pp"):
            raise LayoutError(
                f"order {self.order!r} gives different pipeline groups in the dense and expert views; "
                "put pp outside tp, cp, ep and dp (e.g. tp-cp-ep-dp-pp)"
            )
        if self.hcp is not None and math.prod(self.hcp) != self.cp:
            raise LayoutError(
                f"hierarchical CP sizes {list(self.hcp)} multiply to {math.prod(self.hcp)}, not cp={self.cp}"
            )

    def ranks(self, token: str) -> list[list[int]]:
        """Dense-view groups for a hyphen-joined token such as ``tp``, ``dp-cp`` or ``tp-dp-cp``."""
        return self._dense.ranks(token, DENSE_TOKENS, "dense")

    def expert_ranks(self, token: str) -> list[list[int]]:
        """Expert-view groups: ``tp`` is expert TP, ``dp`` expert DP; e.g. ``ep``, ``tp-ep``, ``tp-ep-pp``."""
        return self._expert.ranks(token, EXPERT_TOKENS, "expert")

    def embedding_ranks(self) -> list[list[int]]:
        """First and last stage of each pipeline group: they share tied embedding weights."""
        return [[g[0], g[-1]] if len(g) > 1 else g for g in self.ranks("pp")]

    def hcp_ranks(self) -> list[list[list[int]]]:
        """Hierarchical CP levels: level 0 takes consecutive members of each CP group, level 1 strides over them."""
        if self.hcp is None:
            return []
        levels: list[list[list[int]]] = [[] for _ in self.hcp]
        for cp_group in self.ranks("cp"):
            inner_stride = 1
            for level, size in enumerate(self.hcp):
                span = inner_stride * size
                for block in range(self.cp // span):
                    for offset in range(inner_stride):
                        start = block * span + offset
                        levels[level].append([cp_group[start + i * inner_stride] for i in range(size)])
                inner_stride = span
        return [sorted(level) for level in levels]

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index in every dense (tp, cp, dp, pp) and expert (etp, ep, edp) dimension."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world_size={self.world_size}")
        dense = self._dense.coords(rank)
        expert = self._expert.coords(rank)
        return {"tp": dense["tp"], "cp": dense["cp"], "dp": dense["dp"], "pp": dense["pp"],
                "etp": expert["tp"], "ep": expert["ep"], "edp": expert["dp"]}

    def to_dict(self) -> dict:
        """Every standard group as rank lists: the JSON that ``pretrain groups --json`` prints."""
        out = {
            "dense": {t: self.ranks(t) for t in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp")},
            "expert": {t: self.expert_ranks(t) for t in ("tp", "ep", "dp", "tp-ep", "tp-ep-pp")},
        }
        if self.hcp is not None:
            out["hcp"] = self.hcp_ranks()
        return out
