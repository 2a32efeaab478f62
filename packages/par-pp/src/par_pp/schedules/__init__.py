"""Schedule generators by name, and where each schedule puts the model's chunks."""

from __future__ import annotations

from ..ir import Schedule
from .dualpipev import dualpipev
from .gpipe import gpipe
from .interleaved import interleaved
from .one_f_one_b import one_f_one_b
from .chunk_ranks import linear_chunk_ranks, v_chunk_ranks
from .zero_bubble import zb_h1, zb_v

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
_ONE_CHUNK = ("gpipe", "1f1b", "zb-h1")
V_SCHEDULES = ("zb-v", "dualpipev")  # two model chunks per rank, laid out in a V


def chunks_per_rank(name: str, pp: int, vpp: int = 1) -> int:
    """Model chunks each pipeline rank holds under the named schedule: 2 for the V schedules, vpp for
    interleaved, else 1 (and 1 without a pipeline)."""
    return 1 if pp == 1 else _chunks_in_schedule(name, vpp)


def _chunks_in_schedule(name: str, vpp: int) -> int:
    return 2 if name in V_SCHEDULES else vpp


def _check(name: str, pp: int, microbatches: int, vpp: int) -> int:
    """Validate the combination; return the number of chunks per rank it implies."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULE_NAMES)}")
    if pp < 1 or microbatches < 1 or vpp < 1:
        raise ValueError(f"pp={pp}, microbatches={microbatches} and vpp={vpp} must all be >= 1")
    if name in _ONE_CHUNK and vpp != 1:
        raise ValueError(f"{name} runs one chunk per rank, so vpp must be 1 (got vpp={vpp}); use interleaved for vpp > 1")
    if name == "interleaved":
        if vpp < 2:
            raise ValueError(f"interleaved needs vpp >= 2 chunks per rank (got vpp={vpp}); use 1f1b for vpp=1")
    if name in V_SCHEDULES and vpp not in (1, 2):
        raise ValueError(f"{name} always places 2 chunks per rank (V shape); pass vpp=2 or leave it at 1, not vpp={vpp}")
    return _chunks_in_schedule(name, vpp)  # the schedule's own, even at pp = 1


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """Generate and validate the named schedule. ``vpp`` is the chunks per rank for interleaved;
    the V-shaped schedules (zb-v, dualpipev) always use 2 and accept vpp=1 or 2."""
    from ..validate import validate_schedule  # validate imports the IR only; kept local to avoid a cycle

    _check(name, pp, microbatches, vpp)
    if name == "gpipe":
        schedule = gpipe(pp, microbatches)
    elif name == "1f1b":
        schedule = one_f_one_b(pp, microbatches)
    elif name == "interleaved":
        schedule = interleaved(pp, microbatches, vpp)
    elif name == "zb-h1":
        schedule = zb_h1(pp, microbatches)
    elif name == "zb-v":
        schedule = zb_v(pp, microbatches)
    else:
        schedule = dualpipev(pp, microbatches)
    validate_schedule(schedule)
    return schedule


def chunks_on_rank(schedule_or_name: Schedule | str, rank: int, pp: int | None = None, vpp: int = 1) -> list[int]:
    """The global chunk ids (model order) that ``rank`` holds, ascending."""
    if isinstance(schedule_or_name, Schedule):
        return schedule_or_name.chunks_on(rank)
    if pp is None:
        raise ValueError("chunks_on_rank(name, rank, pp, vpp) needs pp when given a schedule name")
    if not 0 <= rank < pp:
        raise ValueError(f"rank={rank} is outside pp={pp}")
    return [c for c, r in enumerate(chunk_ranks(schedule_or_name, pp, vpp)) if r == rank]


def chunk_ranks(name: str, pp: int, vpp: int = 1) -> list[int]:
    """The rank of every global chunk (model order) under the named schedule."""
    per_rank = _check(name, pp, pp, vpp)
    return v_chunk_ranks(pp) if name in V_SCHEDULES else linear_chunk_ranks(pp, per_rank)


__all__ = ["SCHEDULE_NAMES", "build_schedule", "chunk_ranks", "chunks_on_rank", "chunks_per_rank"]
