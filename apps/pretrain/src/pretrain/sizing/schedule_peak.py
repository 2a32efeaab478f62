"""A stage's activation peak, found by walking its pipeline schedule as par-pp's executor runs it.

What each (micro-batch, chunk) keeps, per the executor (``par_pp.executor``):

* ``F``: the chunk's saved set (:class:`ChunkBytes` ``saved``) until its backward frees it;
* a full ``B``: runs the backward (``saved`` still alive, plus the backward's working set), then
  frees the saved set;
* a split ``B`` (ZB-H1, ZB-V): input grad only, with ``retain_graph``: the saved set stays, and the
  gradient arriving at every weight junction is recorded (``junctions``) for the W;
* ``W``: the weight grads from those junctions, then both are freed (chunk 0, which has no input
  grad to send, does its whole backward in its W).

Gradients: under ZeRO-2/3 the trainer turns gradient sync off for the whole schedule (pp > 1) or
for all but the last micro-batch (pp = 1), so par-zero's full, unsharded gradient buffer of the
stage lives from the first backward to the end of the step (``grad_buffer``, on top of the shard
the model state counts). :class:`StagePeak` keeps the peak before and after that point apart, so
one walk serves every ZeRO strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

NONE = float("-inf")


@dataclass(frozen=True)
class ChunkBytes:
    """Bytes one micro-batch of a chunk keeps: its saved set, a split B's recorded junction grads,
    its backward's largest working set beyond the saved set, and its forward's beyond its saved set."""

    saved: float
    junctions: float
    backward: float
    forward: float = 0.0


@dataclass(frozen=True)
class StagePeak:
    """The stage's activation peak before its first backward allocates gradients, and after."""

    before: float
    after: float  # -inf: no backward runs with the full gradients alive

    def with_grads(self, grad_buffer: float) -> float:
        """The peak when ``grad_buffer`` bytes of full gradients live from the first backward on."""
        return max(self.before, self.after + grad_buffer) if grad_buffer else max(self.before, self.after)


def walked_microbatches(schedule: str, pp: int, microbatches: int) -> int:
    """Micro-batches walked: all for GPipe (it keeps them all), else enough to reach the steady
    state (4 x pp, a multiple of pp for interleaved), which repeats the same peak."""
    return microbatches if pp == 1 or schedule == "gpipe" else min(microbatches, 4 * pp)


@lru_cache(maxsize=256)
def _schedule(schedule: str, pp: int, microbatches: int, vpp: int):
    from par_pp import build_schedule

    return build_schedule(schedule, pp, microbatches, vpp)


@lru_cache(maxsize=4096)
def _events(schedule: str, pp: int, vpp: int, microbatches: int, stage: int) -> tuple[tuple, ...]:
    """The distinct moments of ``stage``'s walk over ``microbatches`` (already walked_microbatches), each ``(grads alive, saved sets alive per chunk,
    junction sets alive per chunk, (field, chunk) of the transient on top or None)``, chunks in
    ``chunks_on`` order: the walk once per schedule shape, for any chunk sizes."""
    s = _schedule(schedule, pp, microbatches, vpp)
    index = {c: i for i, c in enumerate(s.chunks_on(stage))}
    saved, junctions, grads, split_done, seen = [0] * len(index), [0] * len(index), False, set(), {}

    def see(extra=None) -> None:
        seen.setdefault((grads, tuple(saved), tuple(junctions), extra), None)

    for a in s.ranks[stage]:
        i, key = index[a.chunk], (a.microbatch, a.chunk)
        if a.kind == "F":
            saved[i] += 1
            see(("forward", i))
        elif a.kind == "B" and a.split:
            if a.chunk > 0:  # chunk 0 sends no input grad: its W does the whole backward
                junctions[i] += 1
                see(("backward", i))
                split_done.add(key)
        elif a.kind == "W" and key in split_done:
            see()
            grads = True
            see()
            saved[i] -= 1
            junctions[i] -= 1
        else:  # a full backward (B, or chunk 0's W)
            see(("backward", i))
            grads = True
            saved[i] -= 1
            see()
    return tuple(seen)


def stage_peak(schedule: str, pp: int, vpp: int, microbatches: int, stage: int,
               chunks: dict[int, ChunkBytes], receive: float = 0.0) -> StagePeak:
    """Walk ``stage``'s actions; ``chunks``: its chunks' bytes by global chunk id; ``receive``: the
    receive buffers alive throughout."""
    if pp == 1:
        (c,) = chunks.values()
        top = c.saved + max(c.backward, c.forward) + receive
        return StagePeak(top, top if microbatches > 1 else NONE)  # m > 1: later backwards meet the buffer
    return _walked_peak(schedule, pp, vpp, microbatches, stage, tuple(chunks[c] for c in sorted(chunks)), receive)


@lru_cache(maxsize=1 << 15)  # the planner's search meets the same stage shape and sizes again and again
def _walked_peak(schedule: str, pp: int, vpp: int, microbatches: int, stage: int,
                 sizes: tuple[ChunkBytes, ...], receive: float) -> StagePeak:
    peak = [NONE, NONE]  # before, after the gradients exist
    for grads, saved, junctions, extra in _events(schedule, pp, vpp, walked_microbatches(schedule, pp, microbatches), stage):
        value = sum(n * c.saved for n, c in zip(saved, sizes)) + sum(n * c.junctions for n, c in zip(junctions, sizes))
        if extra is not None:
            value += getattr(sizes[extra[1]], extra[0])
        peak[grads] = max(peak[grads], value + receive)
    return StagePeak(*peak)
