"""What every chunk of a rank is built with (:class:`ChunkContext`) and par-cp's attention for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from par_cp import ContextParallelAttention
from par_groups import ParallelGroups

from .dropout import DropoutPosition


@dataclass(frozen=True)
class ChunkContext:
    """The process groups and options every chunk of this rank is built with."""

    groups: ParallelGroups
    sequence_parallel: bool
    cp_mode: str  # p2p | a2a | allgather | a2a+p2p
    seq_len: int  # full sequence length (before CP)
    recompute: object  # [model].recompute: none | selective | full, or a list of modules (recompute_policy.py)
    attention_backend: str = "auto"  # par-cp's attention backend: auto | flash | sdpa | torch
    backend: str = "torch"  # torch | te (Transformer Engine layers and attention)
    tp_comm_overlap: bool = False  # SP collectives as rings under the matmuls (par_tp.overlap)
    # A run on fake tensors (plan --simulate; see train_loop.ShapesOnly): MoE layers route as declared
    # (par_moe.DeclaredRouting).
    declared_routing: object | None = None
    qk_clip: bool = False  # [train].muon_qk_clip: the attention cores track their max logit per head (qk_clip.py)
    # where the micro-batch being computed is in the global batch: the dropout masks are its samples'
    dropout: DropoutPosition = field(default_factory=DropoutPosition)
    offload: tuple[str, ...] = ()  # [model].offload (offload.py)
    offloader: object | None = None  # this rank's offload.Offloader when offload is set

    def recomputes(self, module: str, layer: int) -> bool:
        """Whether decoder layer ``layer`` recomputes ``module`` (a name of ``recompute_policy.MODULES``)."""
        from .recompute_policy import modules_at

        modules = modules_at(self.recompute, layer)
        return module in modules and (module == "full" or "full" not in modules)

    def offloads(self, layer: int, position: int | None) -> frozenset[str]:
        """The modules decoder layer ``layer`` (the ``position``-th of its chunk) offloads (offload.py)."""
        from .offload_policy import modules_at

        return modules_at(self.offload, layer, position)


def context_attention(context: ChunkContext, softmax_scale: float | None = None) -> ContextParallelAttention:
    """par-cp's attention for this chunk. At cp=1 without document boundaries it is one torch SDPA
    call on the CPU too (``dense_on_cpu``), as on a GPU: torch's own autograd instead of the block
    kernels' (the same CPU flash kernels, less bookkeeping), and
    the single-rank runs every layout is tested against then check par-cp's kernels against SDPA."""
    g = context.groups
    if context.backend == "te":
        from .te import TEContextAttention

        return TEContextAttention(context, softmax_scale)
    if context.cp_mode == "a2a+p2p":
        return ContextParallelAttention("a2a+p2p", g.cp, inner_group=g.hcp[0], outer_group=g.hcp[1], causal=True,
                                        softmax_scale=softmax_scale, backend=context.attention_backend,
                                        dense_on_cpu=True)
    return ContextParallelAttention(context.cp_mode, g.cp, causal=True, softmax_scale=softmax_scale,
                                    backend=context.attention_backend, dense_on_cpu=True)
