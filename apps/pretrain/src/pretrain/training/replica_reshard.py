"""Under ``[train].buddy_shards = 1`` (par's ZeRO-1, 2 or 3 over the whole dp), a new generation's state, re-sharded.

A generation of another size shards every bucket anew, so no rank's pieces are the ones it held. Each
previous shard ``k`` lives on its owner ``k`` or, when that replica was lost, on its buddy ``k - stride`` (which
stepped it from the same gradients: par_zero/buddy.py; the stride is 1, or under expert parallelism the ranks of a
replica in the dp group, ep x cp, for the dense params, and 1 in the expert-dp group for the experts), and a shard
with neither is refused; the members of the new data-parallel group (at one model-parallel coordinate; the
experts' and the model's buffers over the expert-dp group, one rank of each replica at this rank's expert-parallel
coordinate; a joiner holds nothing) assemble every full tensor from those holders, each
element from exactly one holder summed into zeros on the bits (an integer sum, so -0.0 and NaN payloads
stay as they were), and each takes the pieces it owns now, its buddy's included (under ZeRO-3 the param shards
are those masters, or written from them in bf16). The assembled tensors'
SHA-256 (the checkpoint code's hashing) must be the same on every member of its group, and a joiner takes the
lowest surviving replica's RNG at its coordinate, as a point-to-point rejoin does (replica_transfer.py). The tensors assembled lie
on the model's device and go over the data-parallel group; the host metadata (each member's previous shard,
step and step count, the RNG state, the digests) over the generation's gloo control group, whose members are
every rank: the device group may be NCCL, which refuses host tensors. One full tensor is
held at a time; each is all-reduced whole, so the wire moves more than the pieces a joiner owns (what the
``replica_joined`` event and ``plan`` count).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from par_groups import comm
from par_groups.param_placement import placement_of

from ..checkpoint.integrity import new_hash


def _sum_bits(t: torch.Tensor, group) -> None:
    """All-reduce ``t`` (each element non-zero on at most one member) as integers: the holder's bits exactly."""
    raw = t.view(-1).view(torch.uint8)
    bits = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    comm.all_reduce(bits, group)


def _slices(offsets, size) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, size))


def _pieces(dp, kind: str, buddy=lambda expert: True) -> dict[torch.Tensor, list]:
    """``{param: [(offsets, box)]}`` of ``kind``: this rank's own range and its buddy range of the params of the
    families (``buddy(expert)``: dense False, expert True) whose buddy range it gives."""
    out: dict = {}
    for pieces, of_buddy in ((dp.owned_pieces(kind), False), (dp.buddy_pieces(kind), True)):
        for p, v in pieces.items():
            if not of_buddy or buddy(placement_of(p).expert):
                out.setdefault(p, []).extend(v.boxes)
    return out


class _Family:
    """One family of buckets' sharding over the previous generation, seen from this rank: the dense params over the
    dp group, the experts over the expert-dp group (one rank of each replica). ``rows``: each member's previous
    [index, size] in it, this rank's ``me``; shard ``k``'s buddy is rank ``k - stride``'s (par_zero's buddy_stride)."""

    def __init__(self, rows: list[list[int]], me: int, stride: int) -> None:
        self.alive, self.size = {r[0] for r in rows if r[0] >= 0}, max(r[1] for r in rows)
        self.me, self.stride = me, stride

    def holder(self, k: int) -> int:
        for h in (k, (k - self.stride) % self.size):
            if h in self.alive:
                return h
        raise RuntimeError(f"ZeRO shard {k} of {self.size} has no live copy: its owner and its buddy were both lost")

    def gives_buddy(self) -> bool:
        """Whether this rank's buddy range is a lost owner's shard, which it gives."""
        return self.size > 1 and self.holder((self.me + self.stride) % self.size) == self.me


@torch.no_grad()
def reshard_state(old, new, done: int, control) -> tuple[int, int]:
    """Fill ``new`` (this generation's trainer) from the members' previous trainers (``old``: this rank's,
    None on a joiner) over ``new``'s data-parallel groups (the experts' over its expert-dp group), the host metadata
    over ``control`` (the generation's gloo group over every member); returns (the step to go on from: the members'
    ``done``, the bytes this rank received as a joiner: every piece it owns, 0 on a survivor)."""
    dp, model = new.model.dp, new.model
    buffers = (dp.buffer.dense_groups, dp.buffer.expert_groups)  # the experts' are the dense ones without experts
    states = tuple(dp.optimizer_state.state_kinds())
    for opt in (dp.optimizer, dp.buddy_optimizer):
        if opt is not None:
            opt.prepare_load(states)
    if old is not None:  # the previous generation's shard index and count, the dense buckets' and the experts'
        heads = {placement_of(b.params[0]).expert: b for b in reversed(old.model.dp.buckets)}  # (its groups are gone)
        heads = (heads[False], heads.get(True, heads[False]))  # no experts: the dense index is the expert-dp one
        mine = [n for b in heads for n in (b.shard_lo // b.S, b.N // b.S)] + [done, old.model.dp.step_count]
    else:
        mine = [-1, 0, -1, 0, -1, -1]
    every = _gathered(torch.tensor(mine, dtype=torch.int64), control).tolist()
    members = [dist.get_process_group_ranks(g.inner) for g in buffers]  # dense, expert: among every member's rows
    fams = [_Family([every[r][2 * f: 2 * f + 2] for r in members[f]], mine[2 * f], g.buddy_stride)
            for f, g in enumerate(buffers)]
    # the model's buffers, held whole at each coordinate by every replica: from the member of this rank's expert-dp
    # group (its coordinate's ranks over the replicas) that held the lowest index of it
    first = min(fams[1].alive)
    experts = any(placement_of(b.params[0]).expert for b in dp.buckets)
    for f in fams[:1 + experts]:  # every previous shard has a live copy, or the transfer is refused
        for k in range(f.size):
            f.holder(k)

    kinds = ("master",) + states
    given: dict[str, dict[str, list]] = {}  # what this rank holds for the others: kind -> name -> boxes
    if old is not None:
        names = {t: name for name, t in old.model.full_named_tensors().items()}
        buddy = [f.gives_buddy() for f in fams]
        given = {kind: {names[p]: v for p, v in _pieces(old.model.dp, kind, buddy.__getitem__).items()} for kind in kinds}
    dtypes = {kind: dp.optimizer.range_state(dp.buckets[0], kind).dtype for kind in kinds}
    wanted = {kind: _pieces(dp, kind) for kind in kinds}
    full_shapes = {p: v.full_shape for p, v in dp.owned_pieces("master").items()}
    olds = old.model.full_named_tensors() if old is not None else {}
    digests, received = ([], []), 0  # of the dense group's tensors, of the expert-dp group's
    for name, t in sorted(model.full_named_tensors().items()):
        expert = t not in full_shapes or placement_of(t).expert
        group = buffers[expert].inner
        for kind in kinds if t in full_shapes else ("model",):
            if kind == "model":  # held whole by every replica: from the lowest previous index's rank
                full = olds[name].detach().clone() if old is not None and mine[2] == first else torch.zeros_like(t)
                _sum_bits(full, group)
                boxes = [((0,) * t.dim(), t.detach())]
                at = lambda offsets, box: full  # noqa: E731
            else:
                full = torch.zeros(tuple(full_shapes[t]), dtype=dtypes[kind], device=t.device)
                for offsets, box in given.get(kind, {}).get(name, ()):
                    full[_slices(offsets, box.shape)] = box
                _sum_bits(full, group)
                boxes = wanted[kind].get(t, [])
                at = lambda offsets, box: full[_slices(offsets, box.shape)]  # noqa: E731
            for offsets, box in boxes:
                box.copy_(at(offsets, box))
                received += box.numel() * box.element_size()
            h = new_hash(Path(f"{kind}/{name}"))
            h.update(full.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes() if full.numel() else b"")
            digests[expert].append(h.digest())
    rngs = _gathered(torch.get_rng_state(), control)
    if old is None:  # the RNG of the member at this coordinate that held the lowest previous index
        torch.set_rng_state(rngs[next(r for r in members[1] if every[r][2] == first)].clone())
    for family, ranks in zip(digests, members):
        _check_digests(b"".join(family), ranks, control)
    dp.sync_params()
    dp.step_count = max(r[5] for r in every)
    for opt in (dp.optimizer, dp.buddy_optimizer):
        if opt is not None:
            opt.finish_load({})  # an element-wise optimizer keeps no scalars
    return max(r[4] for r in every), (received if old is None else 0)


def _gathered(t: torch.Tensor, control) -> torch.Tensor:
    """Every member's ``t`` (a host tensor, the same size on each), row ``r`` rank ``r``'s, over ``control``."""
    n = dist.get_world_size(control)
    out = torch.empty(n * t.numel(), dtype=t.dtype)
    comm.all_gather_into_tensor(out, t.contiguous().view(-1), control)
    return out.view(n, *t.shape)


def _check_digests(mine: bytes, members: list[int], control) -> None:
    """Every member of the data-parallel group (``members``: their ranks) assembled the same bits (by SHA-256 of
    each full tensor, one SHA-256 of them all on the wire: the same size at every coordinate), or the transfer
    is refused."""
    digest = new_hash(Path("reshard"))
    digest.update(mine)
    rows = _gathered(torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8), control)[members]
    if not all(torch.equal(rows[0], r) for r in rows):
        raise RuntimeError("a re-sharded state piece arrived damaged: the members' SHA-256 of the assembled "
                           "tensors differ")
