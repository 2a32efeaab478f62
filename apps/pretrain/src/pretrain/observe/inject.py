"""Faults injected on purpose, to prove that the straggler rule and the corruption check name the right
rank: never on unless ``PAR_INJECT`` is set (the tests set it for the ranks they launch).

``PAR_INJECT`` is a comma-separated list of ``KIND:RANK[:ARG]``:

- ``slow:R:PHASE``: rank R busy-waits in PHASE (one of ``BUSY_PHASES``) once per step, 3x its own
  step (as measured on the host over the steps before, less what was injected).
- ``flip_weight:R:STEP``: before (1-based) step STEP, rank R flips the top exponent bit of its first
  owned norm weight (the fp32 master the optimizer updates, so it stays, like a memory error).
- ``flip_state:R:STEP``: the same in its first piece of optimizer state, after step STEP's update (so
  only the copies check at that step can see it; the next update would spread it to the weights).
- ``flip_activation:R:STEP``: in step STEP, the top exponent bit of rank R's first forward output
  flips (once: transient).
- ``flip_hidden:R:STEP``: in step STEP, the top exponent bit of the first element at least 1 of rank
  R's first normalised hidden state (its first decoder layer's first norm's output: a value in [1, 2)
  becomes inf or NaN) flips (once: transient). Under tp, rank R's own share, before any collective.
- ``flip_grad:R:STEP``: in step STEP, the top exponent bit of the first positive element of rank R's
  reduced gradient (its first bucket's optimizer range, after the data-parallel reduction) flips (once).
- ``bad_batch:D:STEP``: data-parallel rank D's share of step STEP holds, in its first micro-batch, token
  ids past the vocabulary (the padded rows, whose logits the head masks): a batch whose loss is
  infinite wherever it is computed, as a data file with ids the tokenizer never makes. Every rank
  reads it so (the replica that trains on it, and any that recomputes it).
- ``matmul:R``: every ``nn.functional.linear`` and ``torch.matmul`` (the TP layers' local matmul too)
  on rank R adds 100 to its
  output's first column (a wrong unit, on every call: persistent).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import torch

from ..errors import UsageError
from .stragglers import BUSY_PHASES

ENV = "PAR_INJECT"
RANK_ENV = "PRETRAIN_FT_RANK"  # the launcher's rank of a fault-tolerant run's process (training/fault_replica.py)
FACTOR = 3.0
KINDS = ("slow", "flip_weight", "flip_state", "flip_activation", "flip_hidden", "flip_grad", "bad_batch", "matmul")
STEPPED = ("flip_weight", "flip_state", "flip_activation", "flip_hidden", "flip_grad", "bad_batch")  # KIND:RANK:STEP


def parse(text: str) -> list[tuple[str, int, str]]:
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, rest = item.partition(":")
        rank, _, arg = rest.partition(":")
        ok = kind in KINDS and rank.isdigit() and (
            arg in BUSY_PHASES if kind == "slow" else arg.isdigit() and int(arg) > 0 if kind in STEPPED
            else arg == "")
        if not ok:
            raise UsageError(f"{ENV}={text!r}: {item!r} is not slow:RANK:PHASE (PHASE one of {', '.join(BUSY_PHASES)}), "
                             f"{'|'.join(STEPPED[:-1])}:RANK:STEP, bad_batch:DP_RANK:STEP or matmul:RANK")
        out.append((kind, int(rank), arg))
    return out


def flip_bit(t: torch.Tensor, bit: int = 30, least: float = 0.0) -> None:
    """Flip one bit (the top exponent bit by default: 1.0 becomes inf, 0.01 about 1e35) of ``t``'s first
    positive element (with ``least``: its first in [least, 2 least)), else its first, in place."""
    flat = t.detach().view(-1)
    positive = ((flat >= least) & (flat < 2 * least) if least else flat > 0).nonzero()
    at = int(positive[0, 0]) if len(positive) else 0
    flat = flat[at:at + 1]
    ints = flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.int16)
    ints ^= 1 << (bit if flat.element_size() == 4 else min(bit, 6))


class Faults:
    """This rank's injected faults; with none (the default) every hook returns at once."""

    def __init__(self, rank: int, entries: list[tuple[str, int, str]]) -> None:
        mine = [(kind, arg) for kind, r, arg in entries if r == rank]
        self.slow = {arg for kind, arg in mine if kind == "slow"}
        self.flip_weight = {int(arg) for kind, arg in mine if kind == "flip_weight"}
        self.flip_state = {int(arg) for kind, arg in mine if kind == "flip_state"}
        self.flip_activation = {int(arg) for kind, arg in mine if kind == "flip_activation"}
        self.flip_hidden = {int(arg) for kind, arg in mine if kind == "flip_hidden"}
        self.flip_grad = {int(arg) for kind, arg in mine if kind == "flip_grad"}
        self.bad_batch = {(r, int(arg)) for kind, r, arg in entries if kind == "bad_batch"}  # data: every rank's
        self.active = bool(mine)
        self.step_no = 0
        self.owned = None  # the owned state of the running step (a flip's target)
        self.started: float | None = None
        self.injected = 0.0  # seconds busy-waited in the current step
        self.clean: list[float] = []  # the steps' host times less what was injected
        self.done: set[str] = set()  # phases slowed in this step
        if any(kind == "matmul" for kind, _ in mine):
            _perturb_matmuls()

    @classmethod
    def from_env(cls, rank: int) -> "Faults":
        """Rank ``rank``'s faults; under ``fault_tolerance = "replica"`` the launcher's rank (``RANK_ENV``): a
        survivor renumbered by a regroup is not the rank a spec named."""
        return cls(int(os.environ.get(RANK_ENV, rank)), parse(os.environ.get(ENV, "")))

    def step(self, step: int, owned) -> None:
        """Step ``step`` (0-based) starts; ``owned()``: this rank's owned state by name (a flip's target,
        ``training.owned_state``)."""
        if not self.active:
            return
        now = time.perf_counter()
        if self.started is not None:
            self.clean.append(now - self.started - self.injected)
        self.started, self.injected, self.done, self.step_no = now, 0.0, set(), step + 1
        self.owned = owned
        if self.step_no in self.flip_weight:
            self._flip(lambda n: n.startswith("master/"))

    def modules(self, chunks: dict) -> None:
        """Hook the module whose output ``flip_hidden`` flips (before any other hook on it sees the output)."""
        if not self.flip_hidden or 0 not in chunks:
            return
        layer = chunks[0].decoder_layers()[0]
        norm = next((m for m in layer.modules() if "norm" in type(m).__name__.lower()), layer)

        def flip(module, inputs, output):
            t = output[0] if isinstance(output, tuple) else output
            if self.step_no in self.flip_hidden and "hidden" not in self.done and torch.is_tensor(t):
                self.done.add("hidden")
                with torch.no_grad():
                    flip_bit(t.data, least=1.0)

        norm.register_forward_hook(flip)

    def reduced(self, dp) -> None:
        """The gradients are reduced (before the norm and the update): flip one bit of this rank's, once."""
        if self.step_no in self.flip_grad and "grad" not in self.done:
            self.done.add("grad")
            with torch.no_grad():
                flip_bit(next(b for b in dp.buckets if b.opt_hi > b.opt_lo).opt_grad)

    def data(self, sampler, vocab_size: int) -> None:
        """Make ``sampler`` (and its copies: a rerun's) read the bad batches."""
        if not self.bad_batch:
            return
        bad = self.bad_batch

        class BadBatches(type(sampler)):
            def train_batch(self, step: int):
                batch = super().train_batch(step)
                if (self.dp_rank, step + 1) not in bad:
                    return batch
                tokens = batch.tokens.clone()
                tokens[0] = vocab_size  # the first padded id: the head gives it no logit
                return replace(batch, tokens=tokens)

        sampler.__class__ = BadBatches

    def _flip(self, chosen) -> None:
        state = self.owned()
        names = [n for n in state if state[n] and chosen(n)]
        name = next((n for n in names if "norm" in n), names[0])
        with torch.no_grad():
            flip_bit(state[name][0])

    def at(self, phase: str) -> None:
        """Busy-wait here if this rank is slowed in ``phase`` (once per step; not before a step was measured)."""
        if phase == "optimizer" and self.step_no in self.flip_state:  # after the update
            self._flip(lambda n: not n.startswith(("master/", "model/")))
        if phase not in self.slow or phase in self.done or not self.clean:
            return
        self.done.add(phase)
        seconds = FACTOR * sorted(self.clean[-5:])[len(self.clean[-5:]) // 2]
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:  # busy: a slow GPU or CPU, not an idle wait
            pass
        self.injected += seconds

    def output(self, y):
        """A forward's output: the backward's slow-down hooked on it, a transient flip applied."""
        if not self.active:
            return y
        t = y[0] if isinstance(y, tuple) else y
        if self.step_no in self.flip_activation and "activation" not in self.done and torch.is_tensor(t):
            self.done.add("activation")
            with torch.no_grad():
                flip_bit(t.data)  # not a change autograd tracks: the graph goes on with the wrong value
        if "backward" in self.slow and torch.is_tensor(t) and t.requires_grad:
            t.register_hook(lambda g: self.at("backward"))
        return y


def _perturb_matmuls() -> None:
    """Every matmul on this process adds 100 to its output's first column: a wrong unit, every call."""
    import torch.nn.functional as F

    linear, matmul = F.linear, torch.matmul

    def wrong(out):
        return torch.cat([out[..., :1] + 100.0, out[..., 1:]], dim=-1)

    from par_tp.layers import _LocalMatmul

    F.linear = lambda *a, **kw: wrong(linear(*a, **kw))
    torch.matmul = lambda *a, **kw: wrong(matmul(*a, **kw))
    _LocalMatmul.linear_kernel = staticmethod(F.linear)  # the TP layers' local matmul (bound at import)
