"""Transformer Engine as the layers' backend (``[model].backend = "te"``, CUDA only).

What changes, and what does not: par-tp keeps the weights (same Parameters, same shards, same
ZeRO buckets and checkpoints) and the TP/SP communication; TE computes

- every rank-local matmul of the TP layers and the KV projections (``te.Linear`` borrowing our
  weight Parameter), so ``[train].fp8`` runs them in FP8 under TE's autocast;
- the attention core (``te.DotProductAttention``, sequence-first ``sbhd``, causal, GQA, the model's
  softmax scale), with TE's own context parallelism for cp > 1 (its names for Megatron's
  cp_comm_type; TE's default load balancing, DUAL_CHUNK_SWAP, is par-cp's zigzag shard, so RoPE
  positions and data sharding stay ours);
- activation recomputation (``te.checkpoint``: its recompute re-enters the FP8 autocast with the
  forward's scaling factors, which torch's checkpoint would not);
- each norm with the matmul after it (``te.LayerNormLinear``, RMSNorm): the decoder layer's input
  norm with ``wq`` (GQA attention), its post-attention norm with the MLP's ``gate`` (dense layers);
  the other projections take the normed output TE returns. The norm moves after the TP entry
  collective (it is per token, so that changes no value), which makes its weight's gradient a
  partial sum over TP even without SP: the layer declares it so where it creates the norm
  (``parallel._norm``). The norm weights stay the layer's Parameters (same names, checkpoints).

The output layer (``lm_head``) stays a PyTorch matmul, as in Megatron: its logits feed the loss,
so it does not run in FP8. Modules of TE's are held, not registered: their FP8 extra state is
not part of our checkpoints.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from par_tp import ColumnParallelLinear, RowParallelLinear, enter_tensor_parallel_region

from .kernels import require

TE_CP_COMM_TYPES = {"p2p": "p2p", "a2a": "a2a", "allgather": "all_gather", "a2a+p2p": "a2a+p2p"}


def _te():
    return require("transformer_engine.pytorch", "[model].backend='te'")


class TELinearKernel:
    """``(x, weight, bias=None) -> y`` through a ``te.Linear`` that holds ``weight`` (our Parameter)."""

    def __init__(self, weight: nn.Parameter) -> None:
        out_features, in_features = weight.shape
        linear = _te().Linear(in_features, out_features, bias=False, params_dtype=weight.dtype, device=weight.device)
        linear.weight = weight  # borrow: TE reads the weight by name at each call
        self.linear = [linear]  # a list: not a submodule, so the Parameter is not registered twice

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        linear = self.linear[0]
        _borrow(linear, "weight", weight)  # the caller's: torch's FSDP2 swaps in its own at each forward
        y = linear(x)
        return y if bias is None else y + bias


def use_te_linears_(module: nn.Module) -> int:
    """Route every TP layer's and KV projection's local matmul through TE (not the output layer's);
    returns how many."""
    count = 0
    head = getattr(module, "lm_head", None)
    for m in module.modules():
        if m is head:
            continue
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            m.linear_kernel = TELinearKernel(m.weight)
            count += 1
        elif type(m) is nn.Linear:
            kernel = TELinearKernel(m.weight)
            m.forward = lambda x, m=m, kernel=kernel: kernel(x, m.weight, m.bias)
            count += 1
    return count


def _borrow(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``module.<name>`` is ``tensor`` (our Parameter, or the one torch's FSDP2 swapped in for this forward)."""
    if getattr(module, name) is not tensor:
        module._parameters[name] = tensor


class TENormProjections:
    """A TP block's ``project`` (``par_tp.TPAttention`` / ``TPSwiGLU``) with the block's input norm inside:
    the entry collective on the un-normed input, then TE's LayerNormLinear (RMSNorm + the ``first``
    matmul, holding our norm and weight Parameters), then the ``others`` on the normed output."""

    def __init__(self, block: nn.Module, norm: nn.RMSNorm, first: str, others: tuple[str, ...]) -> None:
        self.refs = [block, norm]  # a list: the block and norm are not registered twice
        self.first, self.others = first, others
        self.kernel = None  # built at the first call, on the device of the weights

    def _build(self, norm: nn.RMSNorm, weight: torch.Tensor):
        out_features, in_features = weight.shape
        return _te().LayerNormLinear(in_features, out_features, eps=norm.eps, bias=False, normalization="RMSNorm",
                                     return_layernorm_output=True, params_dtype=weight.dtype, device=weight.device)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        block, norm = self.refs
        weight = getattr(block, self.first).weight
        if self.kernel is None:
            self.kernel = self._build(norm, weight)
        _borrow(self.kernel, "layer_norm_weight", norm.weight)
        _borrow(self.kernel, "weight", weight)
        x = enter_tensor_parallel_region(x, block.tp_group, block.sequence_parallel)
        y, normed = self.kernel(x)
        rest = [getattr(block, name) for name in self.others]
        return (y, *(m.forward_local(normed) if isinstance(m, ColumnParallelLinear) else m(normed) for m in rest))


def fuse_norm_(block: nn.Module, norm: nn.RMSNorm) -> None:
    """Move ``norm`` into ``block``'s projections (a TPAttention or a TPSwiGLU) through TE."""
    first, others = ("wq", ("wk", "wv")) if hasattr(block, "wq") else ("gate", ("up",))
    block.project = TENormProjections(block, norm, first, others)


class TEContextAttention(nn.Module):
    """``(q, k, v) [S/cp, B, H, D] -> [S/cp, B, Hq, D]`` through TE's DotProductAttention (and its CP)."""

    layout = "zigzag"  # what TE's load balancing expects; RopeThenContextAttention takes positions from it

    def __init__(self, context, softmax_scale: float | None = None) -> None:
        super().__init__()
        self.context, self.softmax_scale = context, softmax_scale  # None: 1/sqrt(head dim)
        # built at the first call, when the local head counts are known; in a list, not a submodule:
        # TE's modules add an ``_extra_state`` to the state dict, which is not part of our checkpoints
        self.dpa = []

    @property
    def cp_rank_and_size(self) -> tuple[int, int]:
        g = self.context.groups
        return g.rank_in("cp"), g.size("cp")

    def _build(self, q: torch.Tensor, k: torch.Tensor):
        te, context, g = _te(), self.context, self.context.groups
        dpa = te.DotProductAttention(q.shape[2], q.shape[3], num_gqa_groups=k.shape[2], attention_dropout=0.0,
                                     qkv_format="sbhd", attn_mask_type="causal", softmax_scale=self.softmax_scale)
        if g.size("cp") > 1:
            cp_group = [g.hcp[0], g.hcp[1]] if context.cp_mode == "a2a+p2p" else g.cp  # (a2a, p2p), as TE asks
            stream = torch.cuda.Stream(q.device) if q.is_cuda else None  # TE's CP overlaps on a stream of q's GPU
            dpa.set_context_parallel_group(cp_group, dist.get_process_group_ranks(g.cp), stream,
                                           TE_CP_COMM_TYPES[context.cp_mode])
        return dpa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        if cu_seqlens is not None:  # the config refuses packed documents with backend='te'
            raise ValueError("TEContextAttention: packed documents (cu_seqlens) are not wired to TE")
        if not self.dpa:
            self.dpa.append(self._build(q, k))
        out = self.dpa[0](q, k, v)  # [S, B, Hq * D]
        return out.view(q.shape)


def recompute(fn, *args, backend: str):
    """Activation recomputation of ``fn(*args)``: TE's checkpoint under the TE backend (its recompute
    runs in the forward's FP8 autocast and scaling), torch's otherwise."""
    if backend == "te":
        return _te().checkpoint(fn, *args, use_reentrant=False)
    return checkpoint(fn, *args, use_reentrant=False)
