"""Cut a layered model into pipeline chunks: contiguous layer ranges, even or with uneven end stages."""

from __future__ import annotations

from collections import Counter


def split_layers(num_layers: int, num_chunks: int) -> list[range]:
    """``num_chunks`` contiguous ranges covering ``range(num_layers)``; sizes differ by at most one,
    the extra layers going to the earliest chunks (32 layers, 8 chunks -> 4 each, as in the
    explainer; 10 layers, 4 chunks -> 3, 3, 2, 2)."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be >= 1")
    if num_layers < num_chunks:
        raise ValueError(f"num_layers={num_layers} cannot fill num_chunks={num_chunks} (each chunk needs a layer); use at most {num_layers} chunks")
    base, extra = divmod(num_layers, num_chunks)
    ranges, start = [], 0
    for c in range(num_chunks):
        size = base + (1 if c < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_layer_counts(num_layers: int, pp: int, chunks_per_rank: int = 1,
                       first_stage_layers: int = 0, last_stage_layers: int = 0) -> list[int]:
    """Layers on each pipeline rank when rank 0 holds ``first_stage_layers`` and rank pp-1
    ``last_stage_layers`` (Megatron's ``decoder_first/last_pipeline_num_layers``; 0 = not fixed),
    the other ranks sharing the rest evenly. Every count must split evenly over the rank's chunks.

    61 layers, pp 16, first 1, last 0 -> 1, 4 x 15; 126 layers, pp 16, first 7, last 7 -> 7, 8 x 14, 7.
    """
    if first_stage_layers < 0 or last_stage_layers < 0:
        raise ValueError(f"first_stage_layers={first_stage_layers} and last_stage_layers={last_stage_layers} must be >= 0")
    fixed = {r: n for r, n in ((0, first_stage_layers), (pp - 1, last_stage_layers)) if n}
    if fixed and pp < 2:
        raise ValueError(f"first_stage_layers/last_stage_layers need pp >= 2 (got pp={pp}); leave them at 0")
    free = pp - len(fixed)
    rest = num_layers - sum(fixed.values())
    what = f"num_layers={num_layers} with first_stage_layers={first_stage_layers}, last_stage_layers={last_stage_layers}"
    for r, n in fixed.items():
        if n % chunks_per_rank:
            raise ValueError(f"{what}: {n} {'layer' if n == 1 else 'layers'} on stage {r} {'does' if n == 1 else 'do'} not split evenly into its {chunks_per_rank} chunks")
    if free == 0 and rest != 0:
        raise ValueError(f"{what}: the two stages must add up to num_layers at pp={pp}, they add up to {num_layers - rest}")
    if free and (rest < free * chunks_per_rank or rest % (free * chunks_per_rank)):
        raise ValueError(f"{what}: the other {free} {'stage gets' if free == 1 else 'stages get'} {rest} layers, which must split evenly into "
                         f"{free} stages x {chunks_per_rank} chunks of at least one layer")
    even = rest // free if free else 0
    return [fixed.get(r, even) for r in range(pp)]


def split_stages(num_layers: int, chunk_ranks: list[int], first_stage_layers: int = 0,
                 last_stage_layers: int = 0) -> list[range]:
    """Layer ranges of every chunk, in model order, for a schedule's ``chunk_ranks`` (chunk -> rank).

    Without fixed end stages this is :func:`split_layers`. With them, each rank's count (see
    :func:`stage_layer_counts`) is split evenly over the chunks it holds, in any chunk layout
    (interleaved, V-shaped): rank 0 of a V schedule holds both the first and the last chunk.
    """
    if not (first_stage_layers or last_stage_layers):
        return split_layers(num_layers, len(chunk_ranks))
    per_rank = Counter(chunk_ranks)
    pp = len(per_rank)
    if sorted(per_rank) != list(range(pp)) or len(set(per_rank.values())) != 1:
        raise ValueError(f"chunk_ranks={list(chunk_ranks)} must give every rank 0..pp-1 the same number of chunks")
    cpr = per_rank[0]
    counts = stage_layer_counts(num_layers, pp, cpr, first_stage_layers, last_stage_layers)
    ranges, start = [], 0
    for rank in chunk_ranks:
        size = counts[rank] // cpr
        ranges.append(range(start, start + size))
        start += size
    return ranges
