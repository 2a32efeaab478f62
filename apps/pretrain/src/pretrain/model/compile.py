"""``[train].compile``: each transformer block's forward compiled by torch.compile (inductor), as
torchtitan compiles each TransformerBlock: the blocks repeat, so one compilation serves them all.

What is compiled is the block's ``forward``, not its ``__call__``: the hooks around it (ZeRO-3's
gathers, FSDP2's, the pipeline's) stay eager, and the compiled region is the block's math: norms,
RoPE, attention, SwiGLU and the residuals (with ``recompute``, the checkpoint around them too,
which torch.compile traces and recomputes inside its backward). A MoE block compiles its attention
only: routing is data-dependent (per-expert counts, the all-to-all's split sizes), which would
break the graph and recompile as the counts change; the MoE layer and its dispatch stay eager.

Collectives inside a block (TP/SP, CP's all-to-all and all-gather) go through ``par_groups.comm``;
dynamo traces them into the graph as functional collectives, with or without a ``CommWatch``
(the flight recorder, ``[log].flight_records``; ``[log].timing``): the watch records each compiled
block call as one entry (``CommWatch.region``, on the group given), outside the traced region, so
a hang inside one still shows where. CP's ring (``p2p``) always runs its point-to-point batches
eagerly between compiled pieces (dynamo does not compile P2P).

A compiled piece's backward is one autograd node, which the zero-bubble split backward
(par_pp.split_backward) sees as one junction: W re-enters it for the weight grads (the same
gradients as one full backward; the piece's backward is run in B and again in W).
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from par_groups.watch import active_watch


def is_fake_or_meta(module: nn.Module) -> bool:
    """Built on fake tensors (``plan --simulate``) or on meta: there is nothing to compile for."""
    return any(isinstance(p, FakeTensor) or p.is_meta for p in module.parameters())


def compiled_part(block: nn.Module) -> nn.Module:
    """What of a decoder block is compiled: the block, or a MoE block's attention."""
    return block.self_attn if getattr(block, "is_moe", False) else block


def compile_blocks_(blocks: list[nn.Module], group=None) -> list[nn.Module]:
    """Compile each block's forward in place (parameters, names and hooks unchanged); returns the
    modules compiled: none on fake or meta tensors (``plan --simulate`` measures the eager step).
    ``group``: the group an active watch files each compiled call under (the ranks running the
    same blocks, e.g. tp)."""
    compiled = []
    for block in blocks:
        part = compiled_part(block)
        if is_fake_or_meta(part):
            continue
        part.forward = _watched(torch.compile(part.forward, backend="inductor"), type(part).__name__, group)
        compiled.append(part)
    return compiled


def _watched(forward, name: str, group):
    """``forward`` as one flight-record entry while a watch is active (eager: outside the graph)."""
    def call(*args, **kwargs):
        watch = active_watch()
        if watch is None:
            return forward(*args, **kwargs)
        with watch.region(f"compiled {name}", group):
            return forward(*args, **kwargs)

    return call
