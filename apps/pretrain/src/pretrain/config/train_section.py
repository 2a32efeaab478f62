"""The ``[train]`` section: steps, batch, optimizer and its options, precision, device, timeouts."""

from __future__ import annotations

import functools
import math
import os
import sys

from dataclasses import dataclass, field

from par_zero import DECLARED, optimizer_classes
from par_zero.newton_schulz import ADJUST_LR_FNS

from .rules import _choice, _need, _positive, _seed, _timeout

DTYPES = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
TE_FP8 = ("delayed", "current")  # Transformer Engine's FP8 scaling recipes ([model].backend='te')
PAR_FP8 = ("tensorwise", "rowwise", "blockwise", "mxfp8")  # par's own (par_tp.fp8), layout-invariant scales
FP8 = ("off",) + TE_FP8 + PAR_FP8
NAN_POLICIES = ("skip", "stop")
DECAY_STYLES = ("cosine", "linear", "wsd", "inverse-square-root", "constant")  # Megatron's --lr-decay-style
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")  # Megatron's --lr-wsd-decay-style
TORCH_OPTIMIZERS = tuple(n.lower() for n in optimizer_classes() if n != "AdamW")  # torch.optim's, by name
# par-zero's declared optimizers (adamw, muon, sgd, lion: every zero) and the other torch.optim classes
OPTIMIZERS = ("adamw",) + TORCH_OPTIMIZERS + tuple(n for n in DECLARED if n != "adamw" and n not in TORCH_OPTIMIZERS)


MAX_TOKENS_PER_STEP = 1 << 30  # far above any real global batch; beyond it a step would not fit in memory


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    stop_at: int = 0  # 0 = run to `steps`; else end after this step (as a pre-emption would)
    seq_len: int = 64
    global_batch: int = 8  # sequences per optimizer step, over all dp ranks
    # sequences per step per data-parallel rank (torchtitan's local_batch_size); > 0: global_batch = this x dp
    local_batch: int = 0
    micro_batch: int = 0  # sequences per micro-batch per dp rank; 0 = derived
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20  # linear warm-up; more than a shortened `steps` (--set train.steps=2) is clamped, with a note
    # the decay after the warm-up (training/schedule_lr.py: Megatron's formulas): cosine | linear | wsd
    # (warmup-stable-decay) | inverse-square-root | constant
    lr_decay_style: str = "cosine"
    lr_decay_steps: int = 0  # the LR reaches min_lr here (Megatron's --lr-decay-iters); 0 = steps
    # wsd: the decay phase is the last lr_wsd_decay_steps of lr_decay_steps (Megatron's --lr-wsd-decay-iters),
    # or that fraction of them (torchtitan's decay_ratio), shaped linear | cosine | exponential | minus_sqrt
    lr_wsd_decay_steps: int = 0
    lr_wsd_decay_ratio: float = 0.0
    lr_wsd_decay_style: str = "linear"
    # Megatron's sample-based run: train_samples > 0 sets steps = train_samples // global_batch; these and
    # lr_*_samples > 0 put the schedule in samples (each replacing its *_steps key)
    train_samples: int = 0
    lr_warmup_samples: int = 0
    lr_decay_samples: int = 0
    lr_wsd_decay_samples: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8  # AdamW's eps (Megatron's --adam-eps, torchtitan's optimizer.eps)
    # par-zero's declared optimizers, every [parallel].zero: adamw (beta1, beta2), sgd (optimizer_args
    # momentum, dampening, nesterov, e.g. {momentum = 0.9}), lion (optimizer_args betas, default
    # [0.9, 0.99]); or another torch.optim class by name, any case (adagrad, rmsprop, ...; zero = no_shard
    # or torch_fsdp2) built with lr, weight_decay (norms, biases, embeddings excluded) and optimizer_args
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
    # passed it (blocks/qk_clip.py); 0 = off
    muon_qk_clip: float = 0.0
    # adamw's update: auto = torch's fused kernel on CUDA, the explicit ops (bitwise torch's foreach=False)
    # on the CPU; on = the fused kernel on the CPU too (faster there, rounding differs); off = never
    fused_adamw: str = "auto"
    grad_clip: float = 1.0  # 0 = no clipping
    seed: int = 1234  # the initial weights ([data].seed: the data order and the embedded corpus)
    dtype: str = "auto"  # auto = bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # auto = CUDA when a GPU is visible (LOCAL_RANK's), else CPU
    # delayed | current: Transformer Engine's FP8 autocast around each chunk forward ([model].backend=te);
    # tensorwise | rowwise | blockwise | mxfp8: par's FP8 GEMMs in the torch layers (model/fp8.py)
    fp8: str = "off"
    # tensorwise | blockwise with zero = optim_grads_params: ZeRO-3 gathers the FP8 linears' weights as FP8
    # bytes + scales (each rank quantizes its rows), not bf16 (model/fp8_gather.py)
    fp8_param_gather: bool = False
    eval_every: int = 50  # 0 = never
    eval_batches: int = 4
    nproc: int = 2
    collective_timeout_s: float = 300.0  # bounds every collective (a hang names its rank after it)
    join_timeout_s: float = 300.0  # every rank must have joined the rendezvous within it ([train].timeout_s: both)
    preempt_timeout_s: float = 120.0  # after SIGTERM/SIGINT/SIGHUP, ranks have this long to save and exit
    nan_policy: str = "stop"
    # bf16 runs: gradients are accumulated and reduced in this dtype (Megatron's default: fp32)
    grad_reduce_dtype: str = "fp32"
    compile: bool = False  # each transformer block's forward compiled by torch.compile (inductor), as torchtitan
    # replica: a data-parallel replica that dies is fenced and the others go on at the same step and batch (off: the run ends)
    fault_tolerance: str = "off"
    respawn: bool = True  # fault_tolerance = replica: the launcher starts a replacement that rejoins at a step boundary
    # fault_tolerance = replica, --nnodes > 1: a node whose launcher has not beaten in the store for this long is lost
    node_timeout_s: float = 30.0
    # 1: under par's ZeRO-1, 2 or 3 over the whole dp, each rank also steps the next rank's shard (a bitwise live copy for replica)
    buddy_shards: int = 0

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "seq_len", "global_batch", "nproc", "eval_batches")
        _positive("train", self, "stop_at", "micro_batch", "warmup_steps", "eval_every", "local_batch", allow_zero=True)
        self._schedule_rules()
        _seed("[train].seed", self.seed)
        _need(self.global_batch * self.seq_len <= MAX_TOKENS_PER_STEP,
              f"[train].global_batch x seq_len = {self.global_batch} x {self.seq_len} tokens per step is more than "
              f"{MAX_TOKENS_PER_STEP:,} (2**30); lower global_batch or seq_len")
        _need(self.stop_at <= self.steps, f"[train].stop_at={self.stop_at} is after the last step steps={self.steps}")
        _need(self.lr_warmup_samples or self.warmup_steps <= self.steps, f"[train].warmup_steps={self.warmup_steps} exceeds steps={self.steps}; "
                                               f"set [train].warmup_steps to at most {self.steps} (or 0)")
        _need(0 <= self.min_lr <= self.lr, f"[train].min_lr={self.min_lr} must be in 0..lr={self.lr}")
        _need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"[train].beta1={self.beta1}, beta2={self.beta2} must be in [0, 1)")
        _need(self.adam_eps > 0, f"[train].adam_eps={self.adam_eps} must be > 0")
        _need(self.weight_decay >= 0 and self.grad_clip >= 0, "[train].weight_decay and grad_clip must be >= 0")
        _timeout("[train].collective_timeout_s", self.collective_timeout_s)
        _timeout("[train].join_timeout_s", self.join_timeout_s)
        _timeout("[train].preempt_timeout_s", self.preempt_timeout_s)
        _timeout("[train].node_timeout_s", self.node_timeout_s)
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
        _choice("[train].fault_tolerance", self.fault_tolerance, ("off", "replica"))
        _need(self.buddy_shards in (0, 1), f"[train].buddy_shards={self.buddy_shards} is not one of 0, 1")
        _choice("[train].optimizer", self.optimizer, OPTIMIZERS)  # the rest is par-zero's: checks.data_parallel_rules asks it

    def _schedule_rules(self) -> None:
        """The LR schedule's keys (training/schedule_lr.py); train_samples sets steps."""
        _positive("train", self, "lr_decay_steps", "lr_wsd_decay_steps", "train_samples", "lr_warmup_samples",
                  "lr_decay_samples", "lr_wsd_decay_samples", allow_zero=True)
        _choice("[train].lr_decay_style", self.lr_decay_style, DECAY_STYLES)
        _choice("[train].lr_wsd_decay_style", self.lr_wsd_decay_style, WSD_DECAY_STYLES)
        _need(0 <= self.lr_wsd_decay_ratio <= 1, f"[train].lr_wsd_decay_ratio={self.lr_wsd_decay_ratio} must be in [0, 1]")
        if self.train_samples:
            steps = self.train_samples // self.global_batch
            _need(steps >= 1, f"[train].train_samples={self.train_samples} is less than one step of global_batch="
                              f"{self.global_batch} samples")
            object.__setattr__(self, "steps", steps)
        _need(not self.lr_decay_steps or self.warmup_steps <= self.lr_decay_steps,
              f"[train].warmup_steps={self.warmup_steps} exceeds lr_decay_steps={self.lr_decay_steps}; lower one")
        _unit, warmup, decay, wsd = schedule_bounds(self)
        if self.lr_decay_style == "wsd":
            _need(0 < wsd <= decay - warmup,
                  f"[train].lr_decay_style='wsd' needs a decay phase in 1..{decay - warmup} (the steps after the "
                  f"warm-up): set [train].lr_wsd_decay_steps, lr_wsd_decay_ratio or lr_wsd_decay_samples (got {wsd})")

    @property
    def optimizer_class(self) -> str:
        """The optimizer's class name: par-zero's declared one's ('AdamW', 'SGD', ...) or a torch.optim class's."""
        if self.optimizer in DECLARED:
            return DECLARED[self.optimizer].label
        return {n.lower(): n for n in optimizer_classes()}[self.optimizer]

    @property
    def par_fp8(self) -> bool:
        """FP8 by par's own GEMMs (``par_tp.fp8``: layout-invariant scales), not Transformer Engine's."""
        return self.fp8 in PAR_FP8

    @functools.cached_property
    def optimizer_declaration(self):
        """par-zero's declaration of ``optimizer`` (its state per parameter, its step, the strategies it runs
        under) with this section's options: beta1, beta2, adam_eps and fused_adamw for AdamW (Muon's other
        params too), the muon_* keys, or optimizer_args. ValueError for bad options."""
        from par_zero import AdamW, declare_optimizer

        adamw = AdamW((self.beta1, self.beta2), self.adam_eps, {"auto": None, "on": True, "off": False}[self.fused_adamw])
        return declare_optimizer(self.optimizer if self.optimizer in DECLARED else self.optimizer_class,
                                 self.optimizer_kwargs, adamw)

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


def shorten_warmup(data: dict, overridden: set[tuple[str, str]]) -> None:
    """Clamp ``[train].warmup_steps`` to a run shortened by ``--set train.steps=N`` (or PRETRAIN_SET), with a
    note, as torchtitan does; it stays an error (naming the key) when the user set warm-up and length both."""
    train = data.get("train")
    if not isinstance(train, dict):
        return
    chosen = ("train", "warmup_steps") in overridden or ("warmup_steps" in train and not (
        {("train", "steps"), ("train", "train_samples")} & overridden))
    steps, warmup = train.get("steps", TrainConfig.steps), train.get("warmup_steps", TrainConfig.warmup_steps)
    batch, samples = train.get("global_batch", TrainConfig.global_batch), train.get("train_samples", 0)
    if chosen or not all(isinstance(v, int) and not isinstance(v, bool) for v in (steps, warmup, batch, samples)):
        return  # the section's own checks say what is wrong
    if samples > 0 and batch > 0:
        steps = samples // batch
    if 0 < steps < warmup:
        # once per run: the launching process, or torchrun's rank 0 (the local launcher's ranks stay quiet)
        if "RANK" not in os.environ or (os.environ["RANK"] == "0" and "TORCHELASTIC_RUN_ID" in os.environ):
            print(f"note: [train].warmup_steps={warmup} is more than the run's steps={steps}: warm-up clamped to "
                  f"{steps} steps (set [train].warmup_steps to choose)", file=sys.stderr)
        train["warmup_steps"] = steps


def schedule_bounds(t) -> tuple[int, int, int, int]:
    """``(unit, warmup, decay, wsd_decay)`` of the ``[train]`` section ``t``'s LR schedule: one step's size and
    the bounds, in steps (unit 1) or samples (training/schedule_lr.py steps by them)."""
    sampled = t.train_samples or t.lr_warmup_samples or t.lr_decay_samples or t.lr_wsd_decay_samples
    unit = t.global_batch if sampled else 1
    decay_steps = t.lr_decay_steps or t.steps
    decay = t.lr_decay_samples or (t.train_samples if t.train_samples and not t.lr_decay_steps else decay_steps * unit)
    warmup = t.lr_warmup_samples or t.warmup_steps * unit
    wsd = t.lr_wsd_decay_samples or t.lr_wsd_decay_steps * unit or round(decay * t.lr_wsd_decay_ratio)
    return unit, warmup, decay, wsd
