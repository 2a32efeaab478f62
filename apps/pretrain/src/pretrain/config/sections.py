"""The ``[data] [checkpoint] [topology] [log] [profile]`` sections, each validating itself.

``[model]``, ``[parallel]`` and ``[train]`` have a module each (``model_section``, ``parallel_section``,
``train_section``); :mod:`.run_config` reads them all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .rules import _choice, _need, _positive, _seed


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
    # Megatron's --split 949,50,1: train / validation / test weights of each source's tokens, in that order
    # (normalised; replaces valid_fraction); the test part is evaluated once, at the end of the run
    split: list = field(default_factory=list)
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
        if self.split:
            ok = len(self.split) == 3 and all(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < 1e18
                                              for w in self.split)
            _need(ok and self.split[0] > 0 and self.split[1] > 0,
                  f"[data].split={self.split!r} must be three weights [train, valid, test], e.g. [949, 50, 1] "
                  f"(Megatron's --split 949,50,1), train and valid > 0")
            _need(not self.eval_sources, "[data].split cuts each source's validation part: not with eval_path / "
                                         "eval_blend (a separate held-out set); drop one")
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
    def held_out(self) -> tuple[float, float]:
        """The validation and test fractions of each source: ``split``'s, else (valid_fraction, 0)."""
        if not self.split:
            return self.valid_fraction, 0.0
        total = float(sum(self.split))
        return self.split[1] / total, self.split[2] / total

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
    integrity_every: int = 10  # log steps between hash checks of the replicated state (pretrain.training.integrity); 0 = no corruption checks
    flight_records: int = 64  # each rank's last collectives kept for a hang's summary (pretrain.runtime.hang); 0 = off
    wandb: bool = False  # Weights & Biases on rank 0 (the optional `wandb` extra); run id = the run's id
    wandb_project: str = "pretrain"
    wandb_name: str = ""  # "" = W&B's own name
    wandb_tags: tuple[str, ...] = ()
    sample_ids: bool = False  # each rank appends the global sample ids it trained per step to <dir>/samples/rank_R.jsonl

    def __post_init__(self) -> None:
        _positive("log", self, "every")
        _positive("log", self, "flight_records", allow_zero=True)
        _positive("log", self, "integrity_every", allow_zero=True)
        _need(self.peak_tflops >= 0, f"[log].peak_tflops={self.peak_tflops} must be >= 0")


@dataclass(frozen=True)
class ProfileConfig:
    steps: str = ""  # "20-22" or "5": torch.profiler traces of these (1-based) steps; "" = none
    memory: bool = True  # CUDA: a memory snapshot of the window; CPU: the profiler's memory columns
    every: int = 0  # also trace every this-many-th step (torchtitan's profile_freq): N, 2N, ...; 0 = off

    def __post_init__(self) -> None:
        self.window()  # the one-line error for a malformed range
        _positive("profile", self, "every", allow_zero=True)

    def traces(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is traced: in the window of ``steps`` or a multiple of ``every``."""
        window = self.window()
        return (window is not None and window[0] <= step <= window[1]) or (self.every > 0 and step % self.every == 0)

    def window(self) -> tuple[int, int] | None:
        """The first and last profiled step (1-based, inclusive); None when profiling is off."""
        if not self.steps:
            return None
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", self.steps.strip())
        lo, hi = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
        _need(1 <= lo <= hi, f"[profile].steps={self.steps!r} must be a step or a range of steps, e.g. \"20-22\" "
                             f"or \"5\" (1-based, first <= last)")
        return lo, hi
