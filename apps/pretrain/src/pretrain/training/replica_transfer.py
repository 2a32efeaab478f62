"""A replacement replica's state, sent point to point from a live replica at the same model-parallel coordinate.

Every piece the joiner owns (fp32 masters and optimizer state of its trained tensors, the other
parameters and buffers, this process's CPU RNG) goes in one batch of sends through the counted layer
(``par_groups.comm``), followed by each piece's size and SHA-256 (the checkpoint code's hashing:
``checkpoint.integrity.new_hash``), and the scalars (the step, the optimizer's step count and scalar state) as
JSON, with the sender's coordinate (its model-parallel block and HSDP shard). The joiner receives into its own
buffers, refuses state from another coordinate (its pieces may have the joiner's shapes and be other pieces of
the model: another expert-parallel rank's experts), hashes what arrived and refuses a piece whose size or digest
differs. Under ``expert_balance = "replicate+replace"`` each layer's expert placement and the load since its
last re-placement (``experts/...``) go first the same way, checked alike: the joiner routes by them before it
receives the rest, whose pieces (boxes of the full tensors) follow from the placement.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from par_groups import comm

from ..checkpoint.integrity import new_hash
from .owned_state import owned_state

DIGEST = 32  # SHA-256 bytes


def _owned(model) -> list[tuple[str, torch.Tensor]]:
    state = owned_state(model)
    return [(f"{name}#{i}", t) for name in sorted(state) for i, t in enumerate(state[name])]


def _pieces(model) -> list[tuple[str, torch.Tensor]]:
    return _owned(model) + [("rng/cpu", torch.get_rng_state())]


def _placement(experts) -> list[tuple[str, torch.Tensor]]:
    """``experts`` (an ``ExpertReplacer``, or None)'s placement and load, as host integer tensors ``[layers, E]``,
    and its EP ranks' NVLink domains ``[ep]`` (-1: none)."""
    if experts is None or not experts.layers:
        return []
    placements, loads, domains = experts.state()
    return [("experts/placement", torch.tensor(placements, dtype=torch.int64)),
            ("experts/load", torch.tensor(loads, dtype=torch.int64)),
            ("experts/domains", torch.tensor(domains or [-1] * experts.ep, dtype=torch.int64))]


def _adopt(experts, placement: list[tuple[str, torch.Tensor]]) -> None:
    """``experts`` routes by the placement received (:func:`_placement`'s pieces)."""
    got = {name.split("/")[1]: t.tolist() for name, t in placement}
    experts.adopt((got["placement"], got["load"], None if min(got["domains"]) < 0 else got["domains"]))


def _digest(name: str, t: torch.Tensor) -> bytes:
    h = new_hash(Path(name))
    h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def _batch(ops: list[tuple], peer: int, control=None) -> None:
    """``ops``' host tensors over ``control`` (a gloo group: the device group may be NCCL, which refuses them),
    the others over the default group; one batch per group, in the same order on both sides."""
    by_group: dict = {}
    for op, t in ops:
        group = control if control is not None and t.device.type == "cpu" else None
        by_group.setdefault(id(group), (group, []))[1].append(dist.P2POp(op, t, peer, group))
    works = [w for group, p2p in by_group.values() for w in comm.batch_isend_irecv(p2p)]
    for w in works:
        w.wait()


def send_state(model, joiner: int, step: int, control=None, experts=None, block: dict | None = None,
               bias=None) -> int:
    """Send this rank's owned state of ``model`` (its ``RankModel``) to global rank ``joiner``; returns the bytes sent.
    ``control``: the gloo group of the sizes, digests and every host tensor (:func:`_batch`); ``experts``: the
    trainer's ``ExpertReplacer`` (None: no expert re-placement); ``block``: this rank's coordinate, which the
    joiner's must equal; ``bias``: the trainer's ``BiasBalance`` (None: none), whose kept counts go with the scalars
    (the bias itself is a buffer of the owned state)."""
    placement = _placement(experts)
    sent = _send(placement, json.dumps({"block": block}).encode(), joiner, control) if placement else 0
    dp = model.dp
    scalars = json.dumps({"step": step, "optimizer_steps": dp.step_count, "block": block,
                          "scalars": dp.optimizer_state.scalar_state(),
                          "bias_kept": None if bias is None else bias.state()}).encode()
    return sent + _send(_pieces(model), scalars, joiner, control)


def _send(pieces: list[tuple[str, torch.Tensor]], scalars: bytes, joiner: int, control) -> int:
    """``pieces``, then ``scalars`` (JSON), after their sizes and digests; the bytes of the pieces."""
    bufs = [t.detach().contiguous() for _, t in pieces]
    meta = torch.tensor([len(scalars)] + [t.numel() * t.element_size() for t in bufs], dtype=torch.int64)
    digests = torch.tensor(list(b"".join(_digest(n, t) for (n, _), t in zip(pieces, bufs))), dtype=torch.uint8)
    _batch([(dist.isend, meta), (dist.isend, digests), (dist.isend, torch.tensor(list(scalars), dtype=torch.uint8))]
           + [(dist.isend, t) for t in bufs], joiner, control)
    return int(meta[1:].sum())


def send_owned(model, joiner: int) -> None:
    """Send the owned pieces alone, as :func:`send_state` sends them (no RNG, digests or scalars): what
    ``plan`` counts a joiner receiving, sent by ``--simulate``'s fake rank through the counted layer."""
    _batch([(dist.isend, t.detach().contiguous()) for _, t in _owned(model)], joiner)


@torch.no_grad()
def receive_state(model, source: int, control=None, experts=None, block: dict | None = None,
                  bias=None) -> tuple[int, int]:
    """Receive the owned state from global rank ``source`` into ``model``'s buffers (its ``RankModel``), each
    piece checked by size and SHA-256; returns (the step to go on from, the bytes received). ``control`` and
    ``experts`` (which routes by the placement received, before the rest arrives): as :func:`send_state`'s;
    ``block``: this joiner's coordinate, which the source's must equal; ``bias``: adopts the kept counts received."""
    placement, got = _placement(experts), 0
    if placement:
        _, got = _receive(placement, source, control, block)
        _adopt(experts, placement)
    dp = model.dp
    # an optimizer whose state pieces are unpacked copies (Muon's) fills them between the two
    dp.optimizer_state.prepare_load(dp.optimizer_state.state_kinds())
    scalars, size = _receive(_pieces(model), source, control, block)
    dp.sync_params()
    dp.step_count = scalars["optimizer_steps"]
    dp.optimizer_state.finish_load(scalars["scalars"])
    if bias is not None:
        bias.adopt(scalars["bias_kept"])
    return scalars["step"], got + size


def _receive(pieces: list[tuple[str, torch.Tensor]], source: int, control, block: dict | None) -> tuple[dict, int]:
    """Into ``pieces`` (the CPU RNG: set), each checked by size and SHA-256, from a source at coordinate ``block``;
    the scalars sent, the bytes received."""
    meta = torch.empty(len(pieces) + 1, dtype=torch.int64)
    digests = torch.empty(len(pieces) * DIGEST, dtype=torch.uint8)
    _batch([(dist.irecv, meta)], source, control)
    raw = torch.empty(int(meta[0]), dtype=torch.uint8)
    _batch([(dist.irecv, digests), (dist.irecv, raw)], source, control)
    scalars = json.loads(bytes(raw.tolist()).decode())
    if scalars["block"] != block:  # before its pieces, which may not even have this joiner's sizes
        raise RuntimeError(f"state from rank {source} is of coordinate {scalars['block']}, not this joiner's {block}")
    bufs = [torch.empty_like(t) for _, t in pieces]
    _batch([(dist.irecv, t) for t in bufs], source, control)
    for i, ((name, mine), got) in enumerate(zip(pieces, bufs)):
        size = got.numel() * got.element_size()
        if size != int(meta[i + 1]) or _digest(name, got) != bytes(digests[i * DIGEST:(i + 1) * DIGEST].tolist()):
            raise RuntimeError(f"state piece {name} from rank {source} arrived damaged ({size} bytes, "
                               f"{int(meta[i + 1])} sent, SHA-256 differs)")
        if name == "rng/cpu":
            torch.set_rng_state(got)
        else:
            mine.copy_(got)
    return scalars, int(meta[1:].sum())
