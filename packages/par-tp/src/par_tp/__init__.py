"""par-tp: tensor and sequence parallelism (Megatron-style), sequence-first ``[S, B, H]`` activations.

Column-parallel then row-parallel layers need one reduction per block; with sequence
parallelism that all-reduce becomes reduce-scatter + all-gather and norms run on
``[S/tp, B, H]``. Every function and module takes its TP ``ProcessGroup`` explicitly.
"""

from .attention import TPAttention, causal_attention, validate_heads
from .comm import (
    copy_to_tensor_parallel_region,
    enter_tensor_parallel_region,
    exit_tensor_parallel_region,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel_region,
)
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .loss import vocab_parallel_cross_entropy
from .mlp import TPSwiGLU
from .sharding import gather_kv_heads, gather_tensor, kv_head_layout, shard_kv_heads, shard_tensor

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPAttention",
    "TPSwiGLU",
    "VocabParallelEmbedding",
    "causal_attention",
    "copy_to_tensor_parallel_region",
    "enter_tensor_parallel_region",
    "exit_tensor_parallel_region",
    "gather_from_sequence_parallel",
    "gather_from_tensor_parallel_region",
    "gather_kv_heads",
    "gather_tensor",
    "kv_head_layout",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel",
    "scatter_to_tensor_parallel_region",
    "shard_kv_heads",
    "shard_tensor",
    "validate_heads",
    "vocab_parallel_cross_entropy",
]
