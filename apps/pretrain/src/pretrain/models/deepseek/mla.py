"""Multi-head latent attention (DeepSeek-V2/V3), tensor and context parallel (one rank: tp = cp = 1).

Per token: the query comes through a low-rank path ``q_b(norm(q_a(x)))`` (or a full ``q_proj``
when ``q_lora_rank`` is 0); keys and values are expanded per head from one compressed latent
``c = norm(kv_a(x)[:kv_lora_rank])`` by ``kv_b``, plus one RoPE key ``kv_a(x)[kv_lora_rank:]``
shared by every head. A head's query/key is ``[nope | rope]`` (qk_nope_head_dim +
qk_rope_head_dim), its value v_head_dim wide. RoPE uses DeepSeek's interleaved pairs; the
softmax scale is ``1/sqrt(qk_head_dim)``, times YaRN's mscale squared when RoPE is scaled
(``rope_scaling.softmax_mscale``).
Hugging Face names (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), so released checkpoints load unchanged.

Tensor parallel (as Megatron): the down-projections ``q_a``/``kv_a`` and their norms are
replicated; the up-projections ``q_b``/``kv_b`` are column-parallel (heads split) and ``o_proj``
row-parallel. The latents ``[cq | ckv | k_rope]`` (q_lora_rank + kv_lora_rank +
qk_rope_head_dim wide, narrower than hidden) enter the TP region in ONE collective: with
sequence parallelism the down-projections run on this rank's ``S/tp`` tokens and the latents are
all-gathered (backward: reduce-scatter), so the replicated weights hold partial grads
(declared as TP copies with ``partial_grad``); without it the latents are copied (backward: one all-reduce).
Context parallel: K and V are formed per head before par-cp's ring/all-to-all, which then moves
``[S/cp, B, heads/tp, D]`` keys and values with ``D = max(qk_head_dim, v_head_dim)`` (the
narrower side zero-padded: q.k and the output are unchanged).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from par_groups import declare_copies_
from par_tp import ColumnParallelLinear, RowParallelLinear, enter_tensor_parallel_region

from ...blocks.rope import apply_rope_interleaved, rope_for, set_shard_rope_tables_
from ...blocks.rope_scaling import softmax_mscale
from ...blocks.recompute import checkpointed

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm / kv_a_layernorm (not rms_norm_eps)


def softmax_scale(config) -> float:
    return config.qk_head_dim ** -0.5 * softmax_mscale(config.rope_scaling)


def _split_heads(config, q: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor, cos, sin):
    """q ``[S, B, n*dqk]``, kv ``[S, B, n*(dn+dv)]``, k_rope ``[S, B, dr]`` -> q, k ``[S, B, n, dqk]``, v."""
    s, b = q.shape[:2]
    dn, dr = config.qk_nope_head_dim, config.qk_rope_head_dim
    q = q.view(s, b, -1, dn + dr)
    kv = kv.view(s, b, q.shape[2], dn + config.v_head_dim)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    k_nope, v = kv.split([dn, config.v_head_dim], dim=-1)
    q_rope = apply_rope_interleaved(q_rope, cos, sin)
    k_rope = apply_rope_interleaved(k_rope.view(s, b, 1, dr), cos, sin).expand(s, b, q.shape[2], dr)
    return torch.cat([q_nope, q_rope], -1), torch.cat([k_nope, k_rope], -1), v


class ContextMLACore(nn.Module):
    """RoPE at this CP shard's positions, then par-cp attention on K and V padded to one width."""

    def __init__(self, config, attn, seq_len: int, selective: bool, backend: str = "torch") -> None:
        super().__init__()
        self.config, self.attn, self.selective, self.seq_len, self.backend = config, attn, selective, seq_len, backend
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)
        self.init_buffers_(torch.get_default_device())

    def init_buffers_(self, device: torch.device) -> None:
        set_shard_rope_tables_(self, device, self.seq_len, self.config.qk_rope_head_dim)

    def _core(self, q, kv, k_rope, docs):
        cos, sin = rope_for(self, docs, q.dtype, self.config.qk_rope_head_dim)
        q, k, v = _split_heads(self.config, q, kv, k_rope, cos, sin)
        width = max(q.shape[-1], v.shape[-1])
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return self.attn(q, k, v, None if docs is None else docs.cu_seqlens)[..., : self.config.v_head_dim]

    def forward(self, q, kv, k_rope, docs=None):
        if self.selective and torch.is_grad_enabled():  # recompute attention only
            return checkpointed(self._core, q, kv, k_rope, docs, backend=self.backend, replay=False)
        return self._core(q, kv, k_rope, docs)


class TPMLAttention(nn.Module):
    """MLA with heads split over TP (see the module docstring); input/output like ``par_tp.TPAttention``."""

    def __init__(self, config, tp_group, sequence_parallel: bool, core: ContextMLACore, comm_overlap: bool = False,
                 recompute_up: bool = False) -> None:
        super().__init__()
        self.config, self.tp_group, self.sp, self.core = config, tp_group, sequence_parallel, core
        # [model].recompute's mla_up_proj: the up-projections, RoPE and the attention core rerun in the
        # backward, which keeps the latents only (the per-head q, k, v are the widest tensors MLA
        # saves, and the core saves them as its inputs: rerunning the core with them is what frees them)
        self.recompute_up = recompute_up
        n, dqk, sp = config.heads, config.qk_head_dim, sequence_parallel
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(config.hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, n * dqk, tp_group)
        else:
            self.q_proj = ColumnParallelLinear(config.hidden, n * dqk, tp_group, sequence_parallel=sp, comm_overlap=comm_overlap)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(config.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(config.kv_lora_rank, n * (config.qk_nope_head_dim + config.v_head_dim), tp_group)
        # tp_comm_overlap: the exit's reduce-scatter rings under o_proj (the latent entry is small
        # and split before its matmuls, so it stays one all-gather)
        self.o_proj = RowParallelLinear(n * config.v_head_dim, config.hidden, tp_group, input_is_parallel=True,
                                        sequence_parallel=sp, comm_overlap=comm_overlap)
        # Copies on every TP rank; with SP each sees its S/tp tokens, so their grads are partial sums.
        for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
            if hasattr(self, name):
                declare_copies_(getattr(self, name), tp_group, partial_grad=sp)

    def forward(self, x: torch.Tensor, docs=None) -> torch.Tensor:
        config = self.config
        c, k_rope = self.kv_a_proj_with_mqa(x).split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
        parts = [self.kv_a_layernorm(c), k_rope]
        if config.q_lora_rank:
            parts.insert(0, self.q_a_layernorm(self.q_a_proj(x)))
        latent = enter_tensor_parallel_region(torch.cat(parts, -1), self.tp_group, self.sp)  # the one entry
        if config.q_lora_rank:
            cq, c, k_rope = latent.split([config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
            q = self.q_b_proj.forward_local(cq)
        else:
            c, k_rope = latent.split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
            q = self.q_proj(x)  # a second entry (all-gather of x) only without the q low-rank path
        if self.recompute_up and torch.is_grad_enabled():
            if config.q_lora_rank:
                out = checkpointed(self._up_and_core, cq, c, k_rope, docs, backend=self.core.backend, replay=False)
            else:
                out = checkpointed(self._kv_up_and_core, q, c, k_rope, docs, backend=self.core.backend, replay=False)
        else:
            out = self.core(q, self.kv_b_proj.forward_local(c), k_rope, docs)
        return self.o_proj(out.reshape(*out.shape[:2], -1))

    def _kv_up_and_core(self, q, c, k_rope, docs):
        return self.core._core(q, self.kv_b_proj.forward_local(c), k_rope, docs)

    def _up_and_core(self, cq, c, k_rope, docs):
        return self._kv_up_and_core(self.q_b_proj.forward_local(cq), c, k_rope, docs)

    @torch.no_grad()
    def load_full_(self, state, prefix: str) -> "TPMLAttention":
        """Copy this rank's part of every MLA tensor from the full state (names under ``prefix``)."""
        for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
            if hasattr(self, name):
                getattr(self, name).weight.copy_(state[f"{prefix}{name}.weight"])
        for name in ("q_b_proj", "q_proj", "kv_b_proj", "o_proj"):
            if hasattr(self, name):
                getattr(self, name).load_full_(state[f"{prefix}{name}.weight"])
        return self
