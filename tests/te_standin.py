"""A CPU stand-in for the parts of Transformer Engine that ``[model].backend='te'`` and ``[train].fp8``
call, so the trainer's TE wiring runs (and is compared with the PyTorch backend) without a GPU.

It has TE 2.x's names, signatures and contracts, checked against the source of
transformer_engine 2.20 (``transformer_engine.pytorch``: ``Linear``, ``DotProductAttention`` and
its ``set_context_parallel_group``, ``LayerNormLinear`` (RMSNorm), ``autocast``, ``checkpoint``; ``transformer_engine.common.recipe``),
and plain fp32 PyTorch math: FP8 is not emulated, so a TE run must equal a PyTorch one. What it
checks on top of the math, as TE does or requires:

- a Linear (or LayerNormLinear) runs at most once inside one FP8 autocast region when the recipe reduces amaxes
  (TE's documented contract for delayed scaling), and records the region's amax reduction group;
- attention takes ``sbhd`` tensors of the load-balanced CP shard TE expects (DUAL_CHUNK_SWAP: of
  2*cp chunks rank r holds chunks r and 2*cp-1-r) and returns ``[S, B, H*D]``; under CP it
  all-gathers K and V (over both groups for a2a+p2p) and masks at global positions;
- ``checkpoint`` recomputes inside an FP8 region with the forward's recipe, as TE's does.

    with te_standin.installed() as record:   # sys.modules entries, removed on exit
        ...                                  # record.linear_calls, record.regions, ...
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint


@dataclass(eq=False)
class Region:
    enabled: bool
    recipe: object
    group: object
    recompute: bool = False  # opened by checkpoint's recompute
    ran: set = field(default_factory=set)  # ids of the Linears that ran in it


@dataclass
class Record:
    linear_calls: int = 0  # Linear and LayerNormLinear
    norm_linear_calls: int = 0
    fp8_linear_calls: int = 0
    attention_calls: int = 0
    checkpoints: int = 0
    regions: list = field(default_factory=list)
    devices: set = field(default_factory=set)  # where TE's modules were asked to put their tensors
    cp_comm_types: set = field(default_factory=set)
    active: list = field(default_factory=list)  # the stack of open regions


class _GatherSequence(torch.autograd.Function):
    """All-gather along a new dim 0; backward sums every rank's gradient and keeps this rank's part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _gather_cp(x: torch.Tensor, groups: list, cp_global_ranks: list[int]) -> torch.Tensor:
    """Every CP rank's shard of ``x``, stacked in CP-rank order (cp_global_ranks)."""
    owners = torch.tensor([dist.get_rank()], device=x.device)
    for group in groups:  # a2a+p2p: the a2a group, then the p2p group across them
        x, owners = _GatherSequence.apply(x, group), _GatherSequence.apply(owners, group)
    x, owners = x.flatten(0, len(groups) - 1), owners.flatten().tolist()
    return x[[owners.index(r) for r in cp_global_ranks]]


def _shard_positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * cp - 1 - rank)])


def _modules(record: Record) -> dict[str, types.ModuleType]:
    class DelayedScaling:
        def __init__(self, margin=0, fp8_format=None, amax_history_len=1024, amax_compute_algo="max",
                     reduce_amax=True, **kwargs):
            self.reduce_amax = reduce_amax

    class Float8CurrentScaling:
        reduce_amax = False  # no amax history: nothing is reduced at a region's end

        def __init__(self, fp8_format=None, **kwargs):
            pass

    class autocast:  # noqa: N801 (TE's name)
        def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
            self.region = Region(enabled, recipe, amax_reduction_group)

        def __enter__(self):
            record.active.append(self.region)
            record.regions.append(self.region)
            return self

        def __exit__(self, *exc):
            record.active.remove(self.region)

    def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
        return autocast(enabled, calibrating, fp8_recipe, fp8_group, _graph)

    def current() -> Region | None:
        return record.active[-1] if record.active else None

    class Module(nn.Module):  # TE's modules keep their FP8 metadata as extra state in the state dict
        def get_extra_state(self):
            return torch.empty(0, dtype=torch.uint8)

        def set_extra_state(self, state):
            pass

    class Linear(Module):
        def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                     tp_group=None, tp_size=1, get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                     bias=True, return_bias=False, params_dtype=None, parallel_mode=None, parameters_split=None,
                     device="cuda", **kwargs):
            super().__init__()
            record.devices.add(torch.device(device).type)
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device)) if bias else None

        def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
            record.linear_calls += 1
            region = current()
            if region is not None and region.enabled:
                if getattr(region.recipe, "reduce_amax", False) and id(self) in region.ran:
                    raise RuntimeError("TE stand-in: a Linear ran twice inside one FP8 autocast region "
                                       "(delayed scaling's amaxes would be overwritten before their reduction)")
                region.ran.add(id(self))
                record.fp8_linear_calls += 1
            return F.linear(inp, self.weight, self.bias)

    class LayerNormLinear(Linear):
        def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, fuse_wgrad_accumulation=False,
                     tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                     normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                     return_layernorm_output=False, return_layernorm_output_gathered=False, parameters_split=None,
                     zero_centered_gamma=False, device="cuda", **kwargs):
            super().__init__(in_features, out_features, bias=bias, params_dtype=params_dtype, device=device)
            assert normalization == "RMSNorm" and not zero_centered_gamma, "the stand-in is TE's RMSNorm only"
            self.layer_norm_weight = nn.Parameter(torch.ones(in_features, dtype=params_dtype, device=device))
            self.eps, self.return_layernorm_output = eps, return_layernorm_output

        def forward(self, inp, is_first_microbatch=None, fp8_output=False, fp8_grad=False):
            record.norm_linear_calls += 1
            normed = F.rms_norm(inp, (inp.shape[-1],), self.layer_norm_weight, self.eps)
            out = super().forward(normed)
            return (out, normed) if self.return_layernorm_output else out

    class DotProductAttention(Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="causal", window_size=None, bottom_right_diagonal=None,
                     softcap=0.0, sequence_parallel=False, tp_size=1, get_rng_state_tracker=None, tp_group=None,
                     layer_number=None, attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                     cp_comm_type="p2p", softmax_scale=None, **kwargs):
            super().__init__()
            assert qkv_format == "sbhd" and attn_mask_type == "causal" and attention_dropout == 0.0
            self.heads, self.kv_heads = num_attention_heads, num_gqa_groups or num_attention_heads
            self.head_dim, self.softmax_scale = kv_channels, softmax_scale
            self.cp_group, self.cp_global_ranks = None, None

        def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
            assert cp_comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"), cp_comm_type
            assert isinstance(cp_group, list) == (cp_comm_type == "a2a+p2p"), "a2a+p2p takes [a2a group, p2p group]"
            self.cp_group = cp_group if isinstance(cp_group, list) else [cp_group]
            self.cp_global_ranks = list(cp_global_ranks)
            record.cp_comm_types.add(cp_comm_type)

        def forward(self, query_layer, key_layer, value_layer, attention_mask=None, **kwargs):
            record.attention_calls += 1
            q, k, v = query_layer, key_layer, value_layer  # [S, B, H, D]
            assert (q.shape[2], k.shape[2], q.shape[3]) == (self.heads, self.kv_heads, self.head_dim)
            s = q.shape[0]
            if self.cp_group is None:
                q_pos = k_pos = torch.arange(s, device=q.device)
            else:
                cp = len(self.cp_global_ranks)
                rank = self.cp_global_ranks.index(dist.get_rank())
                q_pos = _shard_positions(s * cp, rank, cp).to(q.device)
                k_pos = torch.cat([_shard_positions(s * cp, r, cp) for r in range(cp)]).to(q.device)
                k, v = (_gather_cp(t, self.cp_group, self.cp_global_ranks).flatten(0, 1) for t in (k, v))
            mask = k_pos[None, :] <= q_pos[:, None]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, H, S, D]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale, enable_gqa=True)
            return out.permute(2, 0, 1, 3).flatten(2)  # [S, B, H * D]

    def checkpoint(function, *args, **kwargs):
        use_reentrant = kwargs.pop("use_reentrant", True)
        region = current()
        recipe = region.recipe if region is not None and region.enabled else None
        record.checkpoints += 1

        def contexts():
            if recipe is None:
                return contextlib.nullcontext(), contextlib.nullcontext()
            recompute = autocast(enabled=True, recipe=recipe)
            recompute.region.recompute = True
            return contextlib.nullcontext(), recompute

        return torch_checkpoint(function, *args, use_reentrant=use_reentrant, context_fn=contexts, **kwargs)

    te = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe_module = types.ModuleType("transformer_engine.common.recipe")
    for name, value in dict(Linear=Linear, LayerNormLinear=LayerNormLinear, DotProductAttention=DotProductAttention, autocast=autocast,
                            fp8_autocast=fp8_autocast, checkpoint=checkpoint).items():
        setattr(pytorch, name, value)
    recipe_module.DelayedScaling, recipe_module.Float8CurrentScaling = DelayedScaling, Float8CurrentScaling
    te.pytorch, te.common, common.recipe = pytorch, common, recipe_module
    return {"transformer_engine": te, "transformer_engine.pytorch": pytorch, "transformer_engine.common": common,
            "transformer_engine.common.recipe": recipe_module}


@contextlib.contextmanager
def installed():
    """The stand-in as ``transformer_engine`` for the trainer (which takes it for CUDA's); yields its Record."""
    from pretrain.blocks import kernels

    record = Record()
    modules = _modules(record)
    saved = {name: sys.modules.get(name) for name in modules}
    need_cuda, optional_module = kernels._need_cuda, kernels.optional_module
    sys.modules.update(modules)
    kernels._need_cuda = lambda device, what: None  # the stand-in runs on the CPU
    kernels.optional_module = lambda name: modules.get(name) or optional_module(name)
    try:
        yield record
    finally:
        kernels._need_cuda, kernels.optional_module = need_cuda, optional_module
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
