"""par's own FP8 training (``[train].fp8 = tensorwise | rowwise | blockwise | mxfp8``) in the torch layers.

Every local matmul of the attention and the MLP (the TP layers' ``linear_kernel``, and the replicated
``nn.Linear`` projections: MLA's down-projections, MTP's ``eh_proj``) runs as par_tp.fp8's FP8 linear; the
weights, their shards, ZeRO buckets and checkpoints stay as they are. What this module decides is each
linear's :class:`~par_tp.fp8.Sharding`, the ranks its scales are reduced over:

- tokens: the cp group (each cp rank holds chunks of the sequence), and tp for another ``nn.Linear`` (MLA's,
  MTP's) under sequence parallelism (its input may be the SP shard; where it is a full copy the MAX
  changes nothing);
- in_features: tp for a row-parallel layer; out_features: tp for a column-parallel one and for the KV
  projections (``nn.Linear`` holding this rank's kv heads);
- never dp, whose replicas hold other data: each dp rank quantizes as one rank does its micro-batch.

The MoE experts' grouped GEMMs run as par_tp.fp8.grouped's, each source rank's rows of an expert quantized
apart (the single rank's micro-batch), F split over expert tp like a column- (w_gate, w_up) or row-parallel
(w_down) layer; the shared experts as another ``nn.Linear`` (their input is the layer's local tokens).

Left in high precision, as the recipes' references do: the output layer (its logits feed the loss), the
MoE router (a top-k of its scores) and the embedding.
"""

from __future__ import annotations

import types

from torch import nn

from par_tp import ColumnParallelLinear, RowParallelLinear, TPAttention
from par_moe.experts import GroupedSwiGLU, SwiGLU
from par_tp.fp8 import FP8GroupedKernel, FP8LinearKernel, Sharding


def use_fp8_linears_(chunk: nn.Module, recipe: str, groups) -> int:
    """Route ``chunk``'s attention and MLP matmuls through FP8 (not the output layer's); returns how many."""
    cp, tp = (groups.cp,), groups.tp
    head = getattr(chunk, "lm_head", None)
    kv = {id(p) for a in chunk.modules() if isinstance(a, TPAttention) for p in (a.wk, a.wv)}
    count = 0
    for m in chunk.modules():
        if m is head:
            continue
        if isinstance(m, ColumnParallelLinear):
            m.linear_kernel = FP8LinearKernel(recipe, Sharding(tokens=cp, out_features=(tp,)))
        elif isinstance(m, RowParallelLinear):
            m.linear_kernel = FP8LinearKernel(recipe, Sharding(tokens=cp, in_features=(tp,)))
        elif isinstance(m, GroupedSwiGLU):
            etp = (groups.etp,)
            column, row = Sharding(out_features=etp), Sharding(in_features=etp)
            m.grouped_kernels = tuple(FP8GroupedKernel(recipe, s) for s in (column, column, row))
        elif isinstance(m, SwiGLU):
            m.linear_kernel = FP8LinearKernel(recipe, Sharding(tokens=cp + (tp,)))
        elif type(m) is nn.Linear:
            sharding = Sharding(tokens=cp, out_features=(tp,)) if id(m) in kv else Sharding(tokens=cp + (tp,))
            m.fp8_kernel = FP8LinearKernel(recipe, sharding)
            # a bound method: a deep copy of the module (certify's fp64 twin) calls its own weight
            m.forward = types.MethodType(_fp8_forward, m)
        else:
            continue
        count += 1
    return count


def _fp8_forward(self: nn.Linear, x):
    return self.fp8_kernel(x, self.weight, self.bias)
