"""The run configuration: TOML sections read into frozen, validated dataclasses.

A config is seven sections, ``[model] [parallel] [train] [data] [checkpoint] [log] [topology]``; every key has a
default, so a file names only what differs. ``--set section.key=value`` overrides (repeatable) are
applied on top; the value is read as a TOML literal (``--set parallel.hcp=[2,2]``,
``--set train.lr=3e-4``) and taken as a plain string when it is not one (``--set log.dir=runs/a``).

Each section validates itself in ``__post_init__``; :meth:`Config.validate_world` checks what
depends on the number of ranks and returns the resolved :class:`Layout` (dp, etp, sequence
parallel, micro-batching). Every problem is a :class:`~pretrain.errors.UsageError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

try:  # Python >= 3.11 ships the TOML reader; tomli is the same module for older ones
    import tomllib as tomli
except ModuleNotFoundError:  # pragma: no cover
    import tomli

from par_groups import LayoutError, RankGrid
from par_pp import chunk_placement, split_stages

from .errors import UsageError

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
ZERO_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params", "torch_fsdp2")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
V_SCHEDULES = ("zb-v", "dualpipev")  # two model chunks per rank, laid out in a V
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("torch", "te")  # who computes the layers' matmuls and attention: PyTorch or Transformer Engine
ATTENTION_BACKENDS = ("auto", "flash", "sdpa", "torch")  # the attention kernel (auto: flash-attn, else SDPA, else pure PyTorch)
FP8 = ("off", "delayed", "current")  # Transformer Engine's FP8 scaling recipes
NAN_POLICIES = ("skip", "stop")
SCORE_FUNCS = ("softmax", "sigmoid")
DISPATCHERS = ("alltoall", "allgather")
ATTENTIONS = ("gqa", "mla")
PLACEMENTS = ("auto", "strict", "off")  # see pretrain.placement
DEFAULT_CONFIG = "tiny.toml"


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise UsageError(message)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _need(value in choices, f"{key}={value!r} is not one of {', '.join(choices)}")


def _positive(section: str, obj, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        low = 0 if allow_zero else 1
        _need(value >= low, f"[{section}].{name}={value} must be >= {low}")


def _validate_mla(m) -> None:
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _need(getattr(m, name) >= 1, f"[model].{name}={getattr(m, name)} must be >= 1 with attention='mla'")
    _positive("model", m, "q_lora_rank", allow_zero=True)
    _need(m.qk_rope_head_dim % 2 == 0, f"[model].qk_rope_head_dim={m.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    _need(m.kv_heads == m.heads, f"[model].kv_heads={m.kv_heads} must equal heads={m.heads} with attention='mla' "
                                 f"(every head has its own K and V, expanded from the latent)")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-3-style decoder; MoE layers (DeepSeek-style) from ``moe_layers_start`` on when num_experts > 0."""

    vocab_size: int = 256
    hidden: int = 64
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    ffn_hidden: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    recompute: str = "none"
    moe_layers_start: int = 0
    num_experts: int = 0
    top_k: int = 2
    moe_ffn_hidden: int = 0  # 0 = ffn_hidden
    shared_experts: int = 0
    score_func: str = "softmax"
    n_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0  # sequence-wise balancing loss (DeepSeek-V3); layout-independent
    z_loss_coeff: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float = 0.0  # 0 = no token dropping
    dispatcher: str = "alltoall"
    norm_topk_prob: bool = True  # sigmoid routing: divide the chosen scores by their sum (DeepSeek-V3)
    # Multi-head latent attention (DeepSeek-V2/V3) when attention = "mla"; see model/mla.py.
    attention: str = "gqa"
    q_lora_rank: int = 0  # 0 = a full-rank q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN RoPE scaling (as Hugging Face's rope_type "yarn"); factor 0 = plain RoPE
    yarn_factor: float = 0.0
    yarn_original_max_positions: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # Multi-token prediction (DeepSeek-V3): mtp_depth sequential modules, loss added with this weight
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.1
    backend: str = "torch"  # te = Transformer Engine layers and attention (CUDA, optional)
    attention_backend: str = "auto"  # auto | flash | sdpa | torch: the attention kernel

    def __post_init__(self) -> None:
        _choice("[model].backend", self.backend, BACKENDS)
        _choice("[model].attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _positive("model", self, "vocab_size", "hidden", "layers", "heads", "kv_heads", "ffn_hidden")
        _positive("model", self, "moe_layers_start", "num_experts", "moe_ffn_hidden", "shared_experts", "mtp_depth",
                  allow_zero=True)
        _choice("[model].attention", self.attention, ATTENTIONS)
        _need(self.heads % self.kv_heads == 0,
              f"[model].kv_heads={self.kv_heads} does not divide heads={self.heads} (grouped-query attention)")
        if self.attention == "mla":
            _validate_mla(self)
        else:
            _need(self.hidden % self.heads == 0, f"[model].heads={self.heads} does not divide hidden={self.hidden}")
            _need(self.head_dim % 2 == 0, f"head_dim=hidden/heads={self.head_dim} must be even for RoPE")
        _need(self.yarn_factor == 0 or self.yarn_factor >= 1, f"[model].yarn_factor={self.yarn_factor} must be 0 "
                                                               f"(no RoPE scaling) or >= 1")
        _need(self.mtp_loss_weight >= 0, f"[model].mtp_loss_weight={self.mtp_loss_weight} must be >= 0")
        _need(self.init_std > 0 and self.norm_eps > 0 and self.rope_theta > 0,
              "[model].init_std, norm_eps and rope_theta must be > 0")
        _choice("[model].recompute", self.recompute, RECOMPUTE)
        _choice("[model].score_func", self.score_func, SCORE_FUNCS)
        _choice("[model].dispatcher", self.dispatcher, DISPATCHERS)
        if self.num_experts:
            _need(1 <= self.top_k <= self.num_experts,
                  f"[model].top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
            _need(self.n_groups >= 1 and self.num_experts % self.n_groups == 0,
                  f"[model].n_groups={self.n_groups} does not divide num_experts={self.num_experts}")
            _need(1 <= self.topk_groups <= self.n_groups,
                  f"[model].topk_groups={self.topk_groups} must be in 1..n_groups={self.n_groups}")
            per_group = self.num_experts // self.n_groups
            _need(self.top_k <= self.topk_groups * per_group,
                  f"[model].top_k={self.top_k} exceeds the {self.topk_groups * per_group} experts in topk_groups="
                  f"{self.topk_groups} groups of {per_group}")
            _need(self.capacity_factor >= 0, f"[model].capacity_factor={self.capacity_factor} must be >= 0 (0 = no drop)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: nope + rope parts under MLA, head_dim otherwise."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def expert_ffn_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.layers - self.moe_layers_start) if self.num_experts else 0

    def is_moe_layer(self, index: int) -> bool:
        """Layer ``index`` (0-based) has routed experts: the first ``moe_layers_start`` layers stay dense."""
        return bool(self.num_experts) and index >= self.moe_layers_start


@dataclass(frozen=True)
class ParallelConfig:
    """The layout; dp (and expert dp) are derived from the world size."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    cp_comm_type: str = "p2p"
    hcp: tuple[int, ...] = ()
    ep: int = 1
    etp: int = 0  # 0 = tp (Megatron's default)
    sequence_parallel: bool | None = None  # None = on when tp > 1
    zero: str = "no_shard"
    hsdp_replicas: int = 1
    schedule: str = "1f1b"
    microbatches: int = 0  # 0 = derived from train.global_batch / (dp * train.micro_batch)
    order: str = "tp-cp-ep-dp-pp"
    placement: str = "auto"  # auto: best order/permutation on the topology; strict: refuse slow tp/ep/a2a; off
    # Megatron's decoder_first/last_pipeline_num_layers: layers on pp rank 0 / pp-1 (0 = even split)
    first_stage_layers: int = 0
    last_stage_layers: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "hcp", tuple(self.hcp))
        _choice("[parallel].placement", self.placement, PLACEMENTS)
        _positive("parallel", self, "tp", "pp", "vpp", "cp", "ep", "hsdp_replicas")
        _positive("parallel", self, "etp", "microbatches", "first_stage_layers", "last_stage_layers", allow_zero=True)
        _choice("[parallel].cp_comm_type", self.cp_comm_type, CP_COMM_TYPES)
        _choice("[parallel].zero", self.zero, ZERO_STRATEGIES)
        _choice("[parallel].schedule", self.schedule, SCHEDULES)
        _need(all(isinstance(s, int) and s >= 1 for s in self.hcp), f"[parallel].hcp={list(self.hcp)} must be positive integers")
        if self.cp_comm_type == "a2a+p2p":
            _need(len(self.hcp) == 2 and math.prod(self.hcp) == self.cp,
                  f"[parallel].cp_comm_type='a2a+p2p' needs hcp=[inner, outer] with inner*outer = cp={self.cp}, "
                  f"got hcp={list(self.hcp)}")
        else:
            _need(not self.hcp, f"[parallel].hcp={list(self.hcp)} is only used with cp_comm_type='a2a+p2p'")
        if self.vpp > 1:
            _need(self.schedule == "interleaved",
                  f"[parallel].vpp={self.vpp} needs schedule='interleaved', got schedule={self.schedule!r}")
        if self.schedule == "interleaved" and self.pp > 1:
            _need(self.vpp > 1, "[parallel].schedule='interleaved' needs vpp >= 2 model chunks per rank")
        if self.zero == "torch_fsdp2":
            _need(self.pp == 1, f"[parallel].zero='torch_fsdp2' is not compatible with pipeline parallelism (pp={self.pp})")
            _need(self.ep == 1, f"[parallel].zero='torch_fsdp2' is not compatible with expert parallelism (ep={self.ep})")
        if self.hsdp_replicas > 1:
            _need(self.zero in ("optim_grads_params", "torch_fsdp2"),
                  f"[parallel].hsdp_replicas={self.hsdp_replicas} needs zero='optim_grads_params' or 'torch_fsdp2' "
                  f"(HSDP shards parameters inside each replica), got zero={self.zero!r}")
        try:  # the order string alone (unknown or repeated tokens); sizes are checked per world
            RankGrid(1, order=self.order)
        except LayoutError as e:
            raise UsageError(f"[parallel].order: {e}") from None

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank holds: vpp for interleaved, 2 for the V schedules, else 1."""
        if self.pp == 1:
            return 1
        return 2 if self.schedule in V_SCHEDULES else self.vpp

    @property
    def uneven(self) -> bool:
        return bool(self.first_stage_layers or self.last_stage_layers)

    def chunk_layers(self, num_layers: int) -> list[range]:
        """Layer range of every pipeline chunk in model order (one chunk when pp = 1)."""
        if self.pp == 1:
            return [range(num_layers)]
        placement = chunk_placement(self.schedule, self.pp, self.vpp)
        try:
            return split_stages(num_layers, placement, self.first_stage_layers, self.last_stage_layers)
        except ValueError as e:
            raise UsageError(f"[parallel] layer split: {e}") from None

    def stage_layers(self, num_layers: int) -> list[list[int]]:
        """The layer ids each pipeline rank holds (all its chunks), by pp rank."""
        placement = chunk_placement(self.schedule, self.pp, self.vpp) if self.pp > 1 else [0]
        out: list[list[int]] = [[] for _ in range(self.pp)]
        for rank, layers in zip(placement, self.chunk_layers(num_layers)):
            out[rank] += list(layers)
        return out


MAX_TOKENS_PER_STEP = 1 << 30  # far above any real global batch; beyond it a step would not fit in memory


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    stop_at: int = 0  # 0 = run to `steps`; else end after this step (as a pre-emption would)
    seq_len: int = 64
    global_batch: int = 8  # sequences per optimizer step, over all dp ranks
    micro_batch: int = 0  # sequences per micro-batch per dp rank; 0 = derived
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = no clipping
    seed: int = 1234
    dtype: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # auto = CUDA when a GPU is visible (LOCAL_RANK's), else CPU
    fp8: str = "off"  # delayed | current: Transformer Engine's FP8 autocast around the step ([model].backend=te)
    eval_every: int = 50  # 0 = never
    eval_batches: int = 4
    nproc: int = 2
    timeout_s: float = 300.0  # bounds every collective and the ranks' rendezvous
    preempt_timeout_s: float = 120.0  # after SIGTERM/SIGINT, ranks have this long to save and exit
    nan_policy: str = "stop"
    # bf16 runs: gradients are accumulated and reduced in this dtype (Megatron's default: fp32)
    grad_reduce_dtype: str = "fp32"

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "seq_len", "global_batch", "nproc")
        _positive("train", self, "stop_at", "micro_batch", "warmup_steps", "eval_every", "eval_batches", "seed",
                  allow_zero=True)
        _need(self.global_batch * self.seq_len <= MAX_TOKENS_PER_STEP,
              f"[train].global_batch x seq_len = {self.global_batch} x {self.seq_len} tokens per step is more than "
              f"{MAX_TOKENS_PER_STEP:,} (2**30); lower global_batch or seq_len")
        _need(self.stop_at <= self.steps, f"[train].stop_at={self.stop_at} is after the last step steps={self.steps}")
        _need(self.warmup_steps <= self.steps, f"[train].warmup_steps={self.warmup_steps} exceeds steps={self.steps}")
        _need(0 <= self.min_lr <= self.lr, f"[train].min_lr={self.min_lr} must be in 0..lr={self.lr}")
        _need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"[train].beta1, beta2 must be in [0, 1)")
        _need(self.weight_decay >= 0 and self.grad_clip >= 0, "[train].weight_decay and grad_clip must be >= 0")
        _need(self.timeout_s > 0, f"[train].timeout_s={self.timeout_s} must be > 0")
        _need(self.preempt_timeout_s > 0, f"[train].preempt_timeout_s={self.preempt_timeout_s} must be > 0")
        _choice("[train].dtype", self.dtype, DTYPES)
        _choice("[train].device", self.device, DEVICES)
        _choice("[train].fp8", self.fp8, FP8)
        _choice("[train].nan_policy", self.nan_policy, NAN_POLICIES)
        _choice("[train].grad_reduce_dtype", self.grad_reduce_dtype, ("fp32", "bf16"))

    @property
    def last_step(self) -> int:
        return self.stop_at or self.steps

    def resolved_dtype(self, device_type: str) -> str:
        """'fp32' or 'bf16': ``auto`` is bf16 on CUDA and fp32 on the CPU."""
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if device_type == "cuda" else "fp32"


@dataclass(frozen=True)
class DataConfig:
    path: str = ""  # "" = the embedded generated dataset; else a prefix written by `pretrain prepare`
    tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizer.json (for `prepare`)
    valid_fraction: float = 0.05
    seed: int = 1234

    def __post_init__(self) -> None:
        _need(0 < self.valid_fraction < 1, f"[data].valid_fraction={self.valid_fraction} must be in (0, 1)")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # "" = <log.dir>/checkpoints
    every: int = 0  # 0 = never (a final checkpoint is the trainer's choice)
    keep: int = 2
    resume: bool = False
    async_save: bool = False
    init_from: str = ""  # a checkpoint (e.g. from `pretrain convert --from-hf`) to take the weights from

    def __post_init__(self) -> None:
        _positive("checkpoint", self, "every", allow_zero=True)
        _positive("checkpoint", self, "keep")


@dataclass(frozen=True)
class TopologyConfig:
    """Where the ranks run, for placement when NVML cannot tell (NVML is asked first)."""

    preset: str = ""  # a par_groups topology preset (dgx-h100, dgx-a100, pcie-8gpu, nvl72)
    file: str = ""  # or a TOML description (`pretrain topo --save` writes one)
    nodes: int = 0  # 0 = as many as the world size needs

    def __post_init__(self) -> None:
        from par_groups.topology import preset_names

        _need(not (self.preset and self.file), "[topology] takes preset or file, not both")
        if self.preset:
            _choice("[topology].preset", self.preset, tuple(preset_names()))
        _positive("topology", self, "nodes", allow_zero=True)


@dataclass(frozen=True)
class LogConfig:
    dir: str = "runs/latest"  # run output directory; log.jsonl goes inside
    every: int = 1
    progress: bool = True
    tensorboard: bool = False
    peak_tflops: float = 0.0  # per device; 0 = look up the GPU (CPU: no MFU)

    def __post_init__(self) -> None:
        _positive("log", self, "every")
        _need(self.peak_tflops >= 0, f"[log].peak_tflops={self.peak_tflops} must be >= 0")


@dataclass(frozen=True)
class Layout:
    """Sizes resolved for one world size (what :meth:`Config.validate_world` returns)."""

    world_size: int
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int
    etp: int
    edp: int
    vpp: int
    chunks_per_rank: int
    sequence_parallel: bool
    micro_batch: int  # sequences per micro-batch on one dp rank
    microbatches: int  # micro-batches per optimizer step on one dp rank
    hcp: tuple[int, ...]
    order: str

    def grid(self) -> RankGrid:
        return RankGrid(self.world_size, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, etp=self.etp,
                        order=self.order, hcp=self.hcp or None)

    @property
    def layers_per_chunk_divisor(self) -> int:
        return self.pp * self.chunks_per_rank


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "topology": TopologyConfig,
}


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    source: str = field(default="", compare=False)  # the file it came from ("" = built in)

    def __post_init__(self) -> None:
        m, p = self.model, self.parallel
        _need(m.is_moe or p.ep == 1, f"[parallel].ep={p.ep} needs MoE layers ([model].num_experts > 0 and "
                                     f"moe_layers_start < layers)")
        if m.is_moe:
            _need(m.num_experts % p.ep == 0, f"[parallel].ep={p.ep} does not divide [model].num_experts={m.num_experts}")
        _need(m.heads % p.tp == 0, f"[parallel].tp={p.tp} does not divide [model].heads={m.heads}; "
                                   f"use one of {_divisors(m.heads)}")
        _need(m.kv_heads % p.tp == 0 or p.tp % m.kv_heads == 0,
              f"[parallel].tp={p.tp} and [model].kv_heads={m.kv_heads}: one must divide the other "
              f"(kv heads are split over tp, or replicated when fewer than tp)")
        chunks = p.pp * p.chunks_per_rank
        if p.uneven:
            _need(p.pp > 1, f"[parallel].first_stage_layers/last_stage_layers need pp >= 2 (got pp={p.pp}); leave them at 0")
            p.chunk_layers(m.layers)  # raises the one-line error when the sizes do not add up
        else:
            _need(m.layers % chunks == 0,
                  f"[model].layers={m.layers} is not divisible by pp*{'vpp' if p.vpp > 1 else 'chunks'}={p.pp}*"
                  f"{p.chunks_per_rank}={chunks}; or set [parallel].first_stage_layers/last_stage_layers")
        if m.mtp_depth and p.pp > 1:  # MTP runs with the output head and needs the shared embedding there
            _need(p.schedule in V_SCHEDULES,
                  f"[model].mtp_depth={m.mtp_depth} with pp={p.pp}: the last stage cannot hold the MTP modules, "
                  f"they need the embedding on the last stage's rank: use schedule zb-v or dualpipev "
                  f"(got {p.schedule!r}), or pp=1")
        if p.cp_comm_type in ("a2a", "a2a+p2p") and p.cp > 1:
            a2a = p.hcp[0] if p.hcp else p.cp
            for name, heads in (("heads", m.heads), ("kv_heads", m.kv_heads)):
                local = max(heads // p.tp, 1)
                _need(local % a2a == 0, f"[parallel].cp_comm_type={p.cp_comm_type!r} splits heads over {a2a} ranks, "
                                        f"which does not divide the {local} [model].{name} per tp rank")
        t = self.train
        _need(t.fp8 == "off" or m.backend == "te",
              f"[train].fp8={t.fp8!r} runs in Transformer Engine's layers: set [model].backend='te' (or fp8='off')")
        _need(t.seq_len % p.cp == 0 and (p.cp == 1 or t.seq_len % (2 * p.cp) == 0),
              f"[train].seq_len={t.seq_len} must be divisible by 2*cp={2 * p.cp} (load-balanced causal CP)")
        if p.zero == "torch_fsdp2":
            _need(not m.tie_embeddings, "[parallel].zero='torch_fsdp2' needs untied embeddings ([model].tie_embeddings=false)")
        if m.tie_embeddings and p.pp > 1:  # the tied weight is one Parameter on the rank holding both ends
            _need(p.schedule in ("zb-v", "dualpipev"),
                  f"[model].tie_embeddings=true with pp={p.pp} needs the first and last chunk on one rank: "
                  f"use schedule zb-v or dualpipev (got {p.schedule!r}), or set tie_embeddings=false")
        if p.pp > 1 and p.schedule == "interleaved" and p.microbatches:
            _need(p.microbatches % p.pp == 0,
                  f"[parallel].microbatches={p.microbatches} must be a multiple of pp={p.pp} for the interleaved schedule")
        _need(self.data.path or m.vocab_size >= 256,
              f"[model].vocab_size={m.vocab_size} is smaller than the embedded byte-level data's 256")

    def validate_world(self, world_size: int) -> Layout:
        """Check everything that depends on the number of ranks; return the resolved layout."""
        p, t = self.parallel, self.train
        _need(world_size >= 1, f"world size {world_size} must be >= 1")
        try:
            grid = RankGrid(world_size, tp=p.tp, cp=p.cp, pp=p.pp, ep=p.ep, etp=p.expert_tp, order=p.order,
                            hcp=p.hcp or None)
        except LayoutError as e:
            raise UsageError(f"[parallel] does not fit {world_size} ranks: {e}") from None
        dp = grid.dp
        sp = p.tp > 1 if p.sequence_parallel is None else (p.sequence_parallel and p.tp > 1)
        if sp:
            _need((t.seq_len // p.cp) % p.tp == 0,
                  f"[train].seq_len={t.seq_len} / cp={p.cp} must be divisible by tp={p.tp} for sequence parallelism")
        micro_batch, microbatches = _micro_batching(t.global_batch, t.micro_batch, p.microbatches, dp, p.pp)
        if p.pp > 1 and p.schedule == "interleaved":
            _need(microbatches % p.pp == 0, f"the interleaved schedule needs micro-batches ({microbatches}) to be a "
                                            f"multiple of pp={p.pp}; set [parallel].microbatches")
        if p.hsdp_replicas > 1:
            _need(dp % p.hsdp_replicas == 0,
                  f"[parallel].hsdp_replicas={p.hsdp_replicas} does not divide dp={dp} (world {world_size})")
        return Layout(world_size=world_size, tp=p.tp, cp=p.cp, pp=p.pp, dp=dp, ep=p.ep, etp=grid.etp, edp=grid.edp,
                      vpp=p.vpp, chunks_per_rank=p.chunks_per_rank, sequence_parallel=sp, micro_batch=micro_batch,
                      microbatches=microbatches, hcp=p.hcp, order=p.order)

    def to_dict(self) -> dict:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["parallel"]["hcp"] = list(self.parallel.hcp)
        if out["parallel"]["sequence_parallel"] is None:
            del out["parallel"]["sequence_parallel"]  # TOML has no null: absent = default
        return out

    def to_toml(self) -> str:
        """The config as TOML that :func:`load_config` reads back to an equal config."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_literal(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)


def _micro_batching(global_batch: int, micro_batch: int, microbatches: int, dp: int, pp: int) -> tuple[int, int]:
    """(sequences per micro-batch, micro-batches per step) on one dp rank; both set -> must agree."""
    _need(global_batch % dp == 0, f"[train].global_batch={global_batch} is not divisible by dp={dp}")
    per_rank = global_batch // dp
    if micro_batch and microbatches:
        _need(micro_batch * microbatches == per_rank,
              f"[train].micro_batch={micro_batch} x [parallel].microbatches={microbatches} must equal "
              f"global_batch/dp={global_batch}/{dp}={per_rank}")
    elif micro_batch:
        _need(per_rank % micro_batch == 0,
              f"[train].micro_batch={micro_batch} does not divide global_batch/dp={global_batch}/{dp}={per_rank}")
        microbatches = per_rank // micro_batch
    elif microbatches:
        _need(per_rank % microbatches == 0,
              f"[parallel].microbatches={microbatches} does not divide global_batch/dp={global_batch}/{dp}={per_rank}")
        micro_batch = per_rank // microbatches
    else:  # default: one sequence per micro-batch under pp (small bubble), one micro-batch without
        micro_batch = 1 if pp > 1 else per_rank
        microbatches = per_rank // micro_batch
    return micro_batch, microbatches


def _divisors(n: int) -> str:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]  # O(sqrt n): n may be huge
    return ", ".join(str(d) for d in sorted(set(small + [n // d for d in small])))


def _toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return repr(value)


# ---- reading -------------------------------------------------------------------------------------


def _coerce(section: str, key: str, value, hint):
    """Check a TOML value against the field's type; ints are accepted where floats are expected."""
    where = f"[{section}].{key}"
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is bool or (origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and bool in args):
        _need(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
        return value
    if hint is int:
        _need(isinstance(value, int) and not isinstance(value, bool), f"{where} must be an integer, got {value!r}")
        return value
    if hint is float:
        _need(isinstance(value, (int, float)) and not isinstance(value, bool), f"{where} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        _need(isinstance(value, str), f"{where} must be a string, got {value!r}")
        return value
    if origin is tuple:
        _need(isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
              f"{where} must be a list of integers, e.g. [2, 2], got {value!r}")
        return tuple(value)
    raise TypeError(f"no reader for {where} of type {hint}")  # a bug here, not bad input


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def config_from_dict(data: dict, source: str = "") -> Config:
    """Build and validate a :class:`Config` from nested dicts; unknown sections or keys are errors."""
    sections = {}
    for section, values in data.items():
        if section not in SECTIONS:
            raise UsageError(f"unknown section [{section}]{_suggest(section, list(SECTIONS))}; "
                             f"valid sections: {', '.join(SECTIONS)}")
        _need(isinstance(values, dict), f"[{section}] must be a table of keys")
        cls = SECTIONS[section]
        hints = typing.get_type_hints(cls)
        valid = [f.name for f in dataclasses.fields(cls)]
        kwargs = {}
        for key, value in values.items():
            if key not in valid:
                raise UsageError(f"unknown key [{section}].{key}{_suggest(key, valid)}; valid keys: {', '.join(valid)}")
            kwargs[key] = _coerce(section, key, value, hints[key])
        sections[section] = cls(**kwargs)
    return Config(**sections, source=source)


def parse_override(text: str) -> tuple[str, str, object]:
    """'parallel.hcp=[2,2]' -> ('parallel', 'hcp', [2, 2]); a bare word that is no TOML literal is a string."""
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name:
        raise UsageError(f"--set {text!r} must look like section.key=value, e.g. --set parallel.tp=2")
    raw = raw.strip()
    try:
        value = tomli.loads(f"v = {raw}")["v"]
    except tomli.TOMLDecodeError:
        value = raw
    return section, name.strip(), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    merged = {s: dict(v) if isinstance(v, dict) else v for s, v in data.items()}
    for text in overrides:
        section, name, value = parse_override(text)
        table = merged.setdefault(section, {})
        _need(isinstance(table, dict), f"[{section}] must be a table of keys")
        table[name] = value
    return merged


def builtin_config_path(name: str):
    """A config shipped inside the package (``tiny.toml``, ``tiny-moe.toml``, ``llama3-8b.toml`` ...)."""
    return resources.files("pretrain") / "configs" / name


def builtin_configs() -> list[str]:
    return sorted(p.name for p in (resources.files("pretrain") / "configs").iterdir() if p.name.endswith(".toml"))


def read_toml(path: str | None) -> tuple[dict, str]:
    """The parsed TOML of ``path`` (None = the embedded default; a bare shipped name also works)."""
    if path is None:
        ref, source = builtin_config_path(DEFAULT_CONFIG), f"<builtin>/{DEFAULT_CONFIG}"
    elif not Path(path).exists() and path in builtin_configs() + [n[:-5] for n in builtin_configs()]:
        name = path if path.endswith(".toml") else path + ".toml"
        ref, source = builtin_config_path(name), f"<builtin>/{name}"
    else:
        ref, source = Path(path), path
        if not ref.is_file():
            raise UsageError(f"config file {path!r} does not exist; shipped configs: {', '.join(builtin_configs())}")
    try:
        return tomli.loads(ref.read_text()), source
    except tomli.TOMLDecodeError as e:
        raise UsageError(f"config {source} is not valid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read config {source}: {e}") from None


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML config (None = the embedded ``tiny.toml``), apply ``--set`` overrides, validate."""
    data, source = read_toml(path)
    return config_from_dict(apply_overrides(data, list(overrides or [])), source=source)
