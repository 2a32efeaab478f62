"""par-cp: context parallel attention (ring, Ulysses, all-gather, hierarchical), packed sequences,
the dynamic CP scheduler, and the attention kernels they run on."""

from .allgather import allgather_attention
from .attention import MODES, ContextParallelAttention, context_parallel_attention
from .hierarchical import hierarchical_attention, hierarchical_cp_rank
from .kernels import BACKENDS, BlockMask, block_backward, block_forward, flash_available, merge_partial
from .ring import ring_attention
from .scheduler import CPSchedule, DocumentSpan, attention_work, schedule_subsamples, span_for
from .segments import segment_attention
from .sharding import LAYOUTS, merge_segments, position_ids, shard_segments, shard_sequence, unshard_sequence
from .ulysses import HeadsToSeq, SeqToHeads, ulysses_attention

__all__ = [
    "BACKENDS", "BlockMask", "CPSchedule", "ContextParallelAttention", "HeadsToSeq", "LAYOUTS", "MODES", "DocumentSpan",
    "SeqToHeads", "allgather_attention", "attention_work", "block_backward", "block_forward", "context_parallel_attention",
    "flash_available", "hierarchical_attention", "hierarchical_cp_rank", "merge_partial", "merge_segments",
    "position_ids", "ring_attention", "schedule_subsamples", "segment_attention", "shard_segments", "shard_sequence",
    "span_for", "ulysses_attention", "unshard_sequence",
]
