"""The ``[parallel] [train] [data] [checkpoint] [topology] [log] [profile]`` sections, each validating itself.

The choice lists of what a package implements come from that package (CP modes from par-cp, ZeRO
strategies from par-zero, schedules from par-pp), so a new mode there is a valid key here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from par_cp import MODES as CP_COMM_TYPES
from par_groups import LayoutError, RankGrid
from par_pp import SCHEDULE_NAMES as SCHEDULES
from par_pp import V_SCHEDULES, chunk_ranks, chunks_per_rank, split_stages
from par_zero import STRATEGIES as ZERO_STRATEGIES
from par_zero import optimizer_classes
from par_zero.newton_schulz import ADJUST_LR_FNS

from .rules import _choice, _need, _positive, _seed, _timeout
from ..errors import UsageError

DTYPES = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
FP8 = ("off", "delayed", "current")  # Transformer Engine's FP8 scaling recipes
NAN_POLICIES = ("skip", "stop")
RANK_ASSIGNMENTS = ("auto", "strict", "off")  # see pretrain.runtime.rank_assignment
OPTIMIZERS = ("adamw",) + tuple(n.lower() for n in optimizer_classes() if n != "AdamW")  # torch.optim's, by name


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
    tp_comm_overlap: bool = False  # Megatron's --tp-comm-overlap: SP gathers/scatters as rings under the matmuls
    zero: str = "no_shard"
    hsdp_replicas: int = 1
    schedule: str = "1f1b"
    microbatches: int = 0  # 0 = derived from train.global_batch / (dp * train.micro_batch)
    order: str = "tp-cp-ep-dp-pp"
    # which process plays each grid position (pretrain.runtime.rank_assignment); was [parallel].placement
    rank_assignment: str = "auto"  # auto: best order/permutation on the topology; strict: refuse slow tp/ep/a2a; off
    # Megatron's decoder_first/last_pipeline_num_layers: layers on pp rank 0 / pp-1 (0 = even split)
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    # Dynamic CP (Megatron's --hybrid-context-parallel, see pretrain.training.dynamic_cp): each document over
    # as many of the dp x cp ranks as its length needs, at most max_seq_per_rank tokens per rank.
    dynamic_cp: bool = False
    max_seq_per_rank: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "hcp", tuple(self.hcp))
        _choice("[parallel].rank_assignment", self.rank_assignment, RANK_ASSIGNMENTS)
        _positive("parallel", self, "tp", "pp", "vpp", "cp", "ep", "hsdp_replicas")
        _positive("parallel", self, "etp", "microbatches", "first_stage_layers", "last_stage_layers", "max_seq_per_rank",
                  allow_zero=True)
        if self.dynamic_cp:
            _need(self.cp > 1, "[parallel].dynamic_cp=true needs cp > 1 (it spreads documents over dp x cp ranks); "
                               "got cp=1")
            _need(self.max_seq_per_rank >= 1, "[parallel].dynamic_cp=true needs max_seq_per_rank >= 1 (tokens one "
                                              "rank holds)")
            _need(self.tp == self.pp == self.ep == 1 and self.cp_comm_type == "p2p",
                  f"[parallel].dynamic_cp=true runs with tp=pp=ep=1 and cp_comm_type='p2p' for now (got tp={self.tp}, "
                  f"pp={self.pp}, ep={self.ep}, cp_comm_type={self.cp_comm_type!r})")
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
        if self.pp > 1 or self.vpp > 1:  # par-pp's rules for a schedule's chunks per rank
            try:
                chunk_ranks(self.schedule, self.pp, self.vpp)
            except ValueError as e:
                raise UsageError(f"[parallel].schedule={self.schedule!r} with vpp={self.vpp}: {e}") from None
        if self.tp_comm_overlap:
            _need(self.tp > 1 and self.sequence_parallel is not False,
                  f"[parallel].tp_comm_overlap=true overlaps sequence parallelism's collectives: it needs tp > 1 and "
                  f"sequence_parallel on, got tp={self.tp}, sequence_parallel={self.sequence_parallel}")
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
        """Model chunks each pipeline rank holds (par-pp's rule: vpp for interleaved, 2 for the V schedules)."""
        return chunks_per_rank(self.schedule, self.pp, self.vpp)

    @property
    def uneven(self) -> bool:
        return bool(self.first_stage_layers or self.last_stage_layers)

    def chunk_layers(self, num_layers: int) -> list[range]:
        """Layer range of every pipeline chunk in model order (one chunk when pp = 1)."""
        if self.pp == 1:
            return [range(num_layers)]
        ranks = chunk_ranks(self.schedule, self.pp, self.vpp)
        try:
            return split_stages(num_layers, ranks, self.first_stage_layers, self.last_stage_layers)
        except ValueError as e:
            raise UsageError(f"[parallel] layer split: {e}") from None

    def stage_layers(self, num_layers: int) -> list[list[int]]:
        """The layer ids each pipeline rank holds (all its chunks), by pp rank."""
        ranks = chunk_ranks(self.schedule, self.pp, self.vpp) if self.pp > 1 else [0]
        out: list[list[int]] = [[] for _ in range(self.pp)]
        for rank, layers in zip(ranks, self.chunk_layers(num_layers)):
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
    # adamw: par-zero's distributed AdamW (beta1, beta2; every [parallel].zero); or a torch.optim class by
    # name, any case (sgd, adagrad, rmsprop, ...; zero = no_shard or torch_fsdp2) built with lr,
    # weight_decay (norms, biases, embeddings excluded) and optimizer_args, e.g. {momentum = 0.9}
    optimizer: str = "adamw"
    optimizer_args: dict = field(default_factory=dict)
    # muon: par-zero's Muon on the hidden matrices (model/muon_split.py), AdamW (beta1, beta2) on the rest,
    # torch.optim.Muon's arithmetic and options; ns_dtype: Newton-Schulz in bf16 (torch's) or fp32
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr_fn: str = "original"  # original | match_rms_adamw | spectral_unclamped
    muon_ns_dtype: str = "bf16"
    # MuonClip's tau (Kimi K2: 100): a head's W_q, W_k rows scaled down after a step whose max logit
    # passed it (model/qk_clip.py); 0 = off
    muon_qk_clip: float = 0.0
    # adamw's update: auto = torch's fused kernel on CUDA, the explicit ops (bitwise torch's foreach=False)
    # on the CPU; on = the fused kernel on the CPU too (~4x faster there, rounding differs); off = never
    fused_adamw: str = "auto"
    grad_clip: float = 1.0  # 0 = no clipping
    seed: int = 1234  # the initial weights ([data].seed: the data order and the embedded corpus)
    dtype: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # auto = CUDA when a GPU is visible (LOCAL_RANK's), else CPU
    fp8: str = "off"  # delayed | current: Transformer Engine's FP8 autocast around each chunk forward ([model].backend=te)
    eval_every: int = 50  # 0 = never
    eval_batches: int = 4
    nproc: int = 2
    collective_timeout_s: float = 300.0  # bounds every collective (a hang names its rank after it)
    join_timeout_s: float = 300.0  # every rank must have joined the rendezvous within it ([train].timeout_s: both)
    preempt_timeout_s: float = 120.0  # after SIGTERM/SIGINT, ranks have this long to save and exit
    nan_policy: str = "stop"
    # bf16 runs: gradients are accumulated and reduced in this dtype (Megatron's default: fp32)
    grad_reduce_dtype: str = "fp32"
    compile: bool = False  # each transformer block's forward compiled by torch.compile (inductor), as torchtitan

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "seq_len", "global_batch", "nproc", "eval_batches")
        _positive("train", self, "stop_at", "micro_batch", "warmup_steps", "eval_every", allow_zero=True)
        _seed("[train].seed", self.seed)
        _need(self.global_batch * self.seq_len <= MAX_TOKENS_PER_STEP,
              f"[train].global_batch x seq_len = {self.global_batch} x {self.seq_len} tokens per step is more than "
              f"{MAX_TOKENS_PER_STEP:,} (2**30); lower global_batch or seq_len")
        _need(self.stop_at <= self.steps, f"[train].stop_at={self.stop_at} is after the last step steps={self.steps}")
        _need(self.warmup_steps <= self.steps, f"[train].warmup_steps={self.warmup_steps} exceeds steps={self.steps}")
        _need(0 <= self.min_lr <= self.lr, f"[train].min_lr={self.min_lr} must be in 0..lr={self.lr}")
        _need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"[train].beta1={self.beta1}, beta2={self.beta2} must be in [0, 1)")
        _need(self.weight_decay >= 0 and self.grad_clip >= 0, "[train].weight_decay and grad_clip must be >= 0")
        _timeout("[train].collective_timeout_s", self.collective_timeout_s)
        _timeout("[train].join_timeout_s", self.join_timeout_s)
        _timeout("[train].preempt_timeout_s", self.preempt_timeout_s)
        _choice("[train].dtype", self.dtype, DTYPES)
        _choice("[train].device", self.device, DEVICES)
        _choice("[train].fp8", self.fp8, FP8)
        _choice("[train].nan_policy", self.nan_policy, NAN_POLICIES)
        _choice("[train].grad_reduce_dtype", self.grad_reduce_dtype, ("fp32", "bf16"))
        _choice("[train].muon_adjust_lr_fn", self.muon_adjust_lr_fn, ADJUST_LR_FNS)
        _choice("[train].muon_ns_dtype", self.muon_ns_dtype, ("bf16", "fp32"))
        _need(0 <= self.muon_momentum < 1 and 1 <= self.muon_ns_steps < 100,
              f"[train].muon_momentum={self.muon_momentum} must be in [0, 1), muon_ns_steps={self.muon_ns_steps} in 1..99")
        _need(self.muon_qk_clip == 0 or (self.muon_qk_clip > 0 and math.isfinite(self.muon_qk_clip)
                                         and self.optimizer == "muon"),
              f"[train].muon_qk_clip={self.muon_qk_clip} must be a finite logit > 0 with optimizer='muon' "
              f"(got optimizer={self.optimizer!r}), or 0 (off)")
        _need(self.optimizer != "muon" or not self.optimizer_args,
              "[train].optimizer='muon' takes the muon_* keys (and beta1, beta2 for its AdamW part), not optimizer_args")
        _choice("[train].fused_adamw", self.fused_adamw, ("auto", "on", "off"))
        _choice("[train].optimizer", self.optimizer, OPTIMIZERS)  # the rest is par-zero's: checks.data_parallel_rules asks it

    @property
    def optimizer_class(self) -> str:
        """What par-zero's ``optimizer`` argument takes: 'AdamW' (its own) or a torch.optim class name."""
        if self.optimizer in ("adamw", "muon"):  # par-zero's own: 'AdamW', 'Muon'
            return {"adamw": "AdamW", "muon": "Muon"}[self.optimizer]
        return {n.lower(): n for n in optimizer_classes()}[self.optimizer]

    @property
    def optimizer_kwargs(self) -> dict:
        """par-zero's ``optimizer_args``: the muon_* keys for 'muon', else ``optimizer_args``."""
        if self.optimizer != "muon":
            return self.optimizer_args
        return {"momentum": self.muon_momentum, "nesterov": self.muon_nesterov, "ns_steps": self.muon_ns_steps,
                "adjust_lr_fn": self.muon_adjust_lr_fn, "ns_dtype": self.muon_ns_dtype}

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
    path: str = ""  # "" = the embedded generated dataset; else a prefix: `pretrain prepare`'s or Megatron's
    # Megatron's --data-path 0.3 web 0.7 code, instead of path: [[0.3, "web"], [0.7, "code"]] (weights normalised)
    blend: list = field(default_factory=list)
    eval_path: str = ""  # a held-out set of its own (or eval_blend); "" = each source's trailing valid_fraction
    eval_blend: list = field(default_factory=list)
    eos: int = -1  # the EOS id of a dataset whose files do not say it (Megatron's own); -1 = the header's
    tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizer.json (for `prepare`)
    valid_fraction: float = 0.05
    seed: int = 1234  # the data order (which window each step reads) and the embedded corpus
    # Packed documents, as Megatron's --reset-attention-mask / --reset-position-ids / --eod-mask-loss:
    # attention stays inside each document, RoPE positions restart at each document, and the loss
    # of predicting the token after an EOS is dropped. They need a dataset whose documents end with EOS.
    document_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False

    def __post_init__(self) -> None:
        from ..data.blend import check_blend, check_held_out

        _need(0 < self.valid_fraction < 1, f"[data].valid_fraction={self.valid_fraction} must be in (0, 1)")
        _seed("[data].seed", self.seed)
        _need(not (self.path and self.blend), "[data] takes path or blend, not both")
        _need(not (self.eval_path and self.eval_blend), "[data] takes eval_path or eval_blend, not both")
        _need(self.eos >= -1, f"[data].eos={self.eos} must be a token id (or -1: the dataset header's)")
        for key in ("blend", "eval_blend"):
            if getattr(self, key):
                check_blend(getattr(self, key), f"[data].{key}")
                object.__setattr__(self, key, [[float(w), p] for w, p in getattr(self, key)])
        check_held_out(self.train_sources, self.eval_sources, "[data].eval_blend" if self.eval_blend else
                       "[data].eval_path")

    @property
    def train_sources(self) -> list:
        """``[[weight, prefix], ...]`` of the training data; [] = the embedded dataset."""
        return self.blend or ([[1.0, self.path]] if self.path else [])

    @property
    def eval_sources(self) -> list:
        """The separate held-out set as ``[[weight, prefix], ...]``; [] = the training sources' tails."""
        return self.eval_blend or ([[1.0, self.eval_path]] if self.eval_path else [])

    @property
    def packed(self) -> bool:
        """Whether any key needs the documents' boundaries (so the dataset's EOS)."""
        return self.document_mask or self.reset_position_ids or self.eod_mask_loss


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ""  # "" = <log.dir>/checkpoints
    every: int = 0  # 0 = never (a final checkpoint is the trainer's choice)
    keep: int = 2
    resume: bool = False
    async_save: bool = False
    init_from: str = ""  # a checkpoint (e.g. from `pretrain convert --from-hf`) to take the weights from
    fallback: bool = False  # resume: a damaged `latest` falls back to the newest intact checkpoint (and says so)
    verify: bool = True  # false: a checkpoint without checksums.json (written before them) loads unverified

    def __post_init__(self) -> None:
        _positive("checkpoint", self, "every", allow_zero=True)
        _positive("checkpoint", self, "keep")


@dataclass(frozen=True)
class TopologyConfig:
    """Where the ranks run, for the rank assignment when NVML cannot tell (NVML is asked first)."""

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
    timing: bool = True  # where each step's time goes, every log line (pretrain.observe.step_timing)
    flight_records: int = 64  # each rank's last collectives kept for a hang's summary (pretrain.runtime.hang); 0 = off
    wandb: bool = False  # Weights & Biases on rank 0 (the optional `wandb` extra); run id = the run's id
    wandb_project: str = "pretrain"
    wandb_name: str = ""  # "" = W&B's own name
    wandb_tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _positive("log", self, "every")
        _positive("log", self, "flight_records", allow_zero=True)
        _need(self.peak_tflops >= 0, f"[log].peak_tflops={self.peak_tflops} must be >= 0")


@dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""  # "20-22" or "5": torch.profiler traces of these (1-based) steps; "" = none
    memory: bool = True  # CUDA: a memory snapshot of the window; CPU: the profiler's memory columns

    def __post_init__(self) -> None:
        self.window()  # the one-line error for a malformed range

    def window(self) -> tuple[int, int] | None:
        """The first and last profiled step (1-based, inclusive); None when profiling is off."""
        if not self.steps:
            return None
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", self.steps.strip())
        lo, hi = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
        _need(1 <= lo <= hi, f"[profile].steps={self.steps!r} must be a step or a range of steps, e.g. \"20-22\" "
                             f"or \"5\" (1-based, first <= last)")
        return lo, hi
