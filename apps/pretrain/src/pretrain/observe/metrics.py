"""Training metrics: a live progress display (rich), ``log.jsonl``, optional TensorBoard and W&B, MFU.

Only rank 0 makes a :class:`MetricsLogger`. Each :meth:`MetricsLogger.log` call writes one JSON
object per step to ``<log.dir>/log.jsonl`` (``step``, ``loss``, ``lr``, ``grad_norm``,
``tokens_per_s``, ``step_time_s``, ``mfu``, ``memory_gb``, ``time`` and any extra keys);
:meth:`MetricsLogger.log_eval` writes ``{"step", "eval_loss"}`` lines (no ``loss`` key). On a
terminal the display is a rich progress bar; otherwise (CI, pipes) a plain line every
``log.every`` steps. MFU = model FLOPs per step (``pretrain.sizing.flops``) / (step time x peak FLOP/s per
device x devices); the peak is ``log.peak_tflops`` or looked up for known GPUs in the dtype the
matmuls run in (``pretrain.observe.peak``; none on the CPU). The step's time breakdown (``time_*_s``,
``pp_bubble``, ``straggler_rank``: ``pretrain.observe.step_timing``) comes in as extra keys; the console
line shows it compactly. TensorBoard and W&B get every numeric key of a record.

W&B (``wandb=`` the init arguments, ``[log] wandb = true``): one W&B run per our run id, so a
resumed run continues its W&B run (``resume="allow"``); its files go to ``<log.dir>/wandb``.
``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..errors import UsageError
from ..runtime.safe_files import replace_for_append
from ..runtime.strict_json import loads
from .peak import lookup_peak_tflops, peak_flops  # noqa: F401 - re-exported: MFU's denominator
from .step_timing import format_timing

WANDB_MISSING = ("[log].wandb = true needs the wandb package, which is not installed: "
                 "pip install 'pretrain[wandb]' (or uv sync --all-packages --extra wandb), or set [log].wandb = false")

def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on CUDA, resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * (1 if sys.platform == "darwin" else 1024) / 1e9


def mfu(flops_per_step: float, step_time_s: float, peak_flops_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    if not peak_flops_per_device or step_time_s <= 0:
        return None
    return flops_per_step / step_time_s / (peak_flops_per_device * devices)


def _set_aside(path: Path) -> Path | None:
    """Move an earlier run's non-empty ``log.jsonl`` to ``log.<its run id>.jsonl`` (a new run starts its own)."""
    if path.is_symlink() or not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        run_id = str(loads(path.open().readline(), nan=True).get("run_id", "previous"))
    except (ValueError, AttributeError):  # UnicodeDecodeError is a ValueError
        run_id = "previous"
    run_id = "".join(c for c in run_id if c.isalnum() or c in "-_") or "previous"  # a file name, whatever the line says
    target, n = path.with_name(f"log.{run_id}.jsonl"), 1
    while target.exists():
        target, n = path.with_name(f"log.{run_id}.{n}.jsonl"), n + 1
    os.replace(path, target)
    return target


def _open_log(path: Path, start_step: int):
    """``log.jsonl`` for appending, keeping only the lines of steps <= ``start_step`` (a resumed run
    repeats the steps after its checkpoint; a new run starts an empty log, the earlier one set aside
    by :func:`_set_aside`). Rewritten via a rename."""
    kept = []
    if start_step > 0 and path.is_file() and not path.is_symlink():
        for line in path.read_text(errors="replace").splitlines():
            try:
                step = loads(line, nan=True).get("step", 0)
            except (ValueError, AttributeError):
                continue
            if isinstance(step, (int, float)) and not isinstance(step, bool) and step <= start_step:
                kept.append(line + "\n")  # a line edited into something else is dropped with the later steps
    return replace_for_append(path, "".join(kept))  # never opened by name: a symlink there is replaced


class MetricsLogger:
    def __init__(self, log_dir: str | Path, *, total_steps: int, flops_per_step: float = 0.0,
                 peak_flops_per_device: float | None = None, devices: int = 1, tokens_per_step: int = 0,
                 device: torch.device = torch.device("cpu"), every: int = 1, progress: bool = True,
                 tensorboard: bool = False, start_step: int = 0, console: Console | None = None,
                 description: str = "train", run_id: str | None = None, wandb: dict | None = None):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        earlier = _set_aside(self.dir / "log.jsonl") if start_step == 0 else None
        self.jsonl = _open_log(self.dir / "log.jsonl", start_step)
        self.total_steps, self.flops_per_step = total_steps, flops_per_step
        self.peak, self.devices, self.tokens_per_step = peak_flops_per_device, devices, tokens_per_step
        self.device, self.every, self.show = device, every, progress
        # soft_wrap: one line per record at any width; off a terminal (a file, a SLURM log) rich would cut at 80 columns
        self.console = console or Console(stderr=False, soft_wrap=True)
        self.last: dict[str, Any] = {}
        self.tb = self._tensorboard() if tensorboard else None
        self.wandb = self._wandb(wandb) if wandb is not None else None
        self._progress = None
        if earlier is not None:
            self.message(f"{self.dir / 'log.jsonl'} held an earlier run's log: kept as {earlier}")
        if progress and self.console.is_terminal:
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                                      console=self.console, transient=False)
            self._task = self._progress.add_task(description, total=total_steps, completed=start_step, stats="")
            self._progress.start()

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self.message("[log].tensorboard is on but the tensorboard package is not installed; skipping it")
            return None
        return SummaryWriter(str(self.dir / "tensorboard"))

    def _wandb(self, init: dict):
        try:
            import wandb
        except ImportError:
            raise UsageError(WANDB_MISSING) from None
        # quiet: W&B names its mode and folder once, at the start, and does not repeat the folder and the
        # last values (our own console's last line) when the run ends
        return wandb.init(dir=str(self.dir), id=self.run_id, resume="allow", settings=wandb.Settings(quiet=True), **init)

    def _scalars(self, record: dict, prefix: str, step: int) -> None:
        """Every numeric value of ``record`` to TensorBoard and W&B."""
        values = {f"{prefix}/{k}": v for k, v in record.items() if k not in ("step", "time")
                  and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def message(self, text: str) -> None:
        """A line above the progress bar (or on its own when there is none)."""
        self.console.print(text, highlight=False, markup=False)

    def log(self, step: int, loss: float, *, step_time: float, lr: float | None = None,
            grad_norm: float | None = None, tokens: int | None = None, **extra: Any) -> dict:
        """Record optimizer step ``step`` (1-based: the number of steps done). Returns the JSON record."""
        tokens = self.tokens_per_step if tokens is None else tokens
        for straggler in extra.pop("stragglers", ()):  # the straggler rule fired (observe/stragglers.py)
            self.log_event("straggler", step=step, **straggler.event())
            self.message(straggler.line(step))
        for imbalance in extra.pop("stage_imbalance", ()):  # the stages against the plan (observe/stage_balance.py)
            self.log_event("stage_imbalance", step=step, **imbalance.event())
            self.message(imbalance.line(step))
        for event in extra.pop("integrity", ()):  # silent-corruption checks (training/integrity.py)
            self.jsonl.write(json.dumps({**event, "time": time.time(), **self._run()}) + "\n")
            if event["event"] == "corruption":
                self.message(f"step {step}: corruption check: {event['class']} on rank {event['rank']} "
                             f"(host {event['host']}, GPU {event['gpu']}), step {event['suspect_step']}'s "
                             f"micro-batch {event['micro_batch']}")
        record = {"step": step, "loss": float(loss), "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
                  "tokens_per_s": tokens / step_time if step_time > 0 else None, "step_time_s": step_time,
                  "mfu": mfu(self.flops_per_step, step_time, self.peak, self.devices),
                  "memory_gb": memory_gb(self.device), "time": time.time(), **extra, **self._run()}
        self.jsonl.write(json.dumps(record) + "\n")
        self.last = record
        self._scalars(record, "train", step)
        stats = self.format(record)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
        elif self.show and (step % self.every == 0 or step == self.total_steps):
            self.message(f"step {step}/{self.total_steps} {stats}")
        return record

    def log_eval(self, step: int, loss: float, split: str = "eval", held_out: str = "") -> dict:
        """A held-out loss; ``split="test"``: [data].split's test part, at the end of the run. ``held_out``:
        what the loss was measured on, in words, for the console line."""
        record = {"step": step, f"{split}_loss": float(loss), "time": time.time(), **self._run()}
        self.jsonl.write(json.dumps(record) + "\n")
        self._scalars({"loss": float(loss)}, split, step)
        if self.show:
            self.message(f"step {step}: {split} loss {loss:.4f}" + (f" on {held_out}" if held_out else ""))
        return record

    def log_event(self, event: str, *, step: int, **fields: Any) -> dict:
        """A record of something that happened at ``step`` (e.g. a re-placement of experts), not a step's metrics."""
        record = {"step": step, "event": event, **fields, "time": time.time(), **self._run()}
        self.jsonl.write(json.dumps(record) + "\n")
        return record

    def _run(self) -> dict:
        return {} if self.run_id is None else {"run_id": self.run_id}

    @staticmethod
    def format(record: dict) -> str:
        parts = [f"loss {record['loss']:.4f}" if math.isfinite(record["loss"]) else f"loss {record['loss']}"]
        if record.get("tokens_per_s"):
            parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
        if record.get("mfu") is not None:
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        parts.append(f"mem {record['memory_gb']:.2f} GB")
        if timing := format_timing(record):
            parts.append(timing)
        return " | ".join(parts)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        self.jsonl.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
