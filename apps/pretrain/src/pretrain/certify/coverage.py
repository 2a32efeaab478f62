"""The vocabulary ids certify's batches must hold: the first and last id of every tensor-parallel
vocabulary shard of the certified layout (and the last real id, where the padding starts).

A fault that touches only some ids (an off-by-one at a shard's edge in the vocab-parallel embedding
or loss) shows only when those ids are in the batch; a sample of natural data may hold none of them
(bytes 0 and 255 are rare in text). So certify writes them into its batches: in each step's global
batch, sequence ``n`` gets ``per_sequence`` of the ids at positions spread over the sequence (each
one both an input and a label), the ``n * per_sequence + i``-th id of the list (from where the
previous step stopped when one step's sequences cannot hold them all). The choice depends only on
the step and the sequence's place in the global batch, so the one-rank reference and every dp rank
of the layout read the same tokens.
"""

from __future__ import annotations

from dataclasses import replace

SHARE = 4  # at most 1/SHARE of a sequence's tokens are replaced


def edge_ids(model, tp: int) -> list[int]:
    """The first and last id of each of the ``tp`` vocabulary shards that are real ids, and the last real id."""
    rows = model.padded_vocab(tp) // tp
    edges = {i for k in range(tp) for i in (k * rows, (k + 1) * rows - 1)}
    return sorted({i for i in edges if i < model.vocab_size} | {model.vocab_size - 1})


def per_sequence(ids: list[int], global_batch: int, seq_len: int) -> int:
    """Ids written into each sequence: enough for one step's batch to hold all, at most 1/SHARE of it."""
    return max(1, min(-(-len(ids) // global_batch), (seq_len - 1) // SHARE))


def placed(ids: list[int], global_batch: int, seq_len: int, step: int, n: int) -> list[tuple[int, int]]:
    """(position in the window of ``seq_len + 1`` tokens, id) for global sequence ``n`` of ``step``."""
    m = per_sequence(ids, global_batch, seq_len)
    first = (step * global_batch + n) * m
    return [(1 + i * (seq_len - 1) // m, ids[(first + i) % len(ids)]) for i in range(m)]


def covered(ids: list[int], global_batch: int, seq_len: int, steps: int) -> list[int]:
    """The ids the batches of ``steps`` steps hold."""
    return sorted({t for s in range(steps) for n in range(global_batch) for _, t in placed(ids, global_batch, seq_len, s, n)})


def install(sampler, ids: list[int]) -> None:
    """Write ``ids`` into this rank's training batches (this sampler only: an instance attribute)."""
    if not ids:
        return
    part = type(sampler).train_batch.__get__(sampler)
    per_rank = sampler.global_batch // sampler.dp_size

    def train_batch(step: int):
        batch = part(step)
        tokens = batch.tokens.clone()
        flat = tokens.view(-1, tokens.shape[-1])
        for row in range(flat.shape[0]):
            for pos, token in placed(ids, sampler.global_batch, sampler.seq_len, step, sampler.dp_rank * per_rank + row):
                flat[row, pos] = token
        return replace(batch, tokens=tokens)

    sampler.train_batch = train_batch
