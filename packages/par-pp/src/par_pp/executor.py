"""Run a schedule on real modules over torch.distributed point-to-point.

Each rank walks its action list in order:

* ``F`` (m, c): the input is microbatch ``m``'s input (chunk 0), or the activation received from
  (or handed over locally by) chunk ``c - 1``; on the last chunk the output goes to
  ``loss_fn(output, target) / microbatches``; other outputs are sent to chunk ``c + 1``.
* ``B`` (m, c), full: backward through the chunk, accumulating weight grads into ``.grad`` and
  sending the input grad to chunk ``c - 1``. Split (zero-bubble): only the input grad
  (``torch.autograd.grad`` w.r.t. the chunk's input, graph kept), sent on at once.
* ``W`` (m, c): the weight-grad work a split B left (``split_backward``): it restarts at the
  nodes where weight branches leave the activation path, so B + W do one backward's work, and
  the gradients are exactly one full backward's.

Gradients accumulate into the chunks' parameters (zero them between optimizer steps); the caller
runs the optimizer. Per-microbatch extra inputs (position ids, masks) reach a chunk through
``forward_fn(chunk_id, module, x, microbatch)``, e.g. a closure over this step's batch: given to the
constructor, or to :meth:`PipelineExecutor.step` / :meth:`PipelineExecutor.forward` for one call
(with ``loss_fn`` too), so a caller keeps no per-step state for the callbacks to read.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from par_groups import comm

from .ir import Action, Message, Schedule, make_schedule
from .p2p import StageComm
from .split_backward import PendingWeightGrad, backward_input, backward_weight


def _call_module(chunk_id: int, module: nn.Module, x: torch.Tensor, microbatch: int) -> torch.Tensor:
    return module(x)


class _Seed(torch.autograd.Function):
    """A scalar whose backward feeds exactly ``grad`` into ``output``, without reading ``output``'s
    values (its storage may be freed: see :func:`_free_storage`)."""

    @staticmethod
    def forward(ctx, output, grad):
        ctx.save_for_backward(grad)
        ctx.dtype = output.dtype
        return grad.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        (grad,) = ctx.saved_tensors
        return grad.to(ctx.dtype), None


def _with_grad(output: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The scalar whose backward is ``backward(output, grad)`` (the same gradients), skipping
    autograd's grad-shape check, which imports sympy on first use (seconds per process where bytecode
    is not cached), and any read of ``output`` (freed once sent)."""
    return _Seed.apply(output, grad)


def _free_storage(output: torch.Tensor) -> None:
    """Drop a sent activation's values, keeping its autograd graph (Megatron's
    ``deallocate_output_tensor``): backward only feeds a gradient into it. A node that saved the
    tensor keeps its own reference to the values, so this frees them only where nothing needs them."""
    output.data = output.new_empty((0,))


@dataclass
class _Live:
    """What a (microbatch, chunk) keeps between its F and its B/W."""

    input: torch.Tensor
    output: torch.Tensor  # the scaled loss on the last chunk; a scalar once the B brings the grad
    pending: PendingWeightGrad | None = None  # a split B's leftover weight-grad work


@dataclass(frozen=True)
class ActionRecord:
    action: Action
    start: float  # time.perf_counter() once the inputs arrived (one clock for all local processes)
    end: float


class PipelineExecutor:
    """Runs ``schedule``'s actions for this rank (its rank in ``pp_group``).

    ``chunks`` maps each global chunk id on this rank (``chunks_on_rank``) to its module.
    ``tied_params``: parameters shared by the first and last chunk (tied embeddings) whose grads
    are summed over ``embedding_group`` after every step (skip the group when both chunks share
    one rank and one Parameter). ``device`` is where received tensors are placed.
    ``message_shape = (shape, dtype)`` declares every activation and gradient message (no shape
    headers; see ``StageComm``).
    """

    def __init__(
        self,
        schedule: Schedule,
        chunks: dict[int, nn.Module],
        pp_group: ProcessGroup,
        *,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tied_params: list[nn.Parameter] | None = None,
        embedding_group: ProcessGroup | None = None,
        forward_fn: Callable[[int, nn.Module, torch.Tensor, int], torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
        message_shape: tuple[tuple[int, ...], torch.dtype] | None = None,
    ):
        pp_group = pp_group if pp_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(pp_group)
        if dist.get_world_size(pp_group) != schedule.pp:
            raise ValueError(f"schedule has pp={schedule.pp} but pp_group has {dist.get_world_size(pp_group)} ranks")
        expected = schedule.chunks_on(self.rank)
        if sorted(chunks) != expected:
            raise ValueError(f"rank {self.rank} holds chunks {expected} in {schedule.name}, got modules for {sorted(chunks)}")
        self.schedule, self.chunks, self.group = schedule, chunks, pp_group
        self.loss_fn, self.forward_fn = loss_fn, forward_fn or _call_module
        self.tied_params, self.embedding_group = list(tied_params or []), embedding_group
        self.device = torch.device(device)
        self.message_shape = message_shape
        self._params = {c: [p for p in m.parameters() if p.requires_grad] for c, m in chunks.items()}
        # Each action with the messages it receives and sends, worked out once (the schedule is fixed).
        self._plan = [(a, schedule.input_message(a), schedule.output_message(a)) for a in schedule.ranks[self.rank]]
        self.records: list[ActionRecord] = []
        self.send_span: Callable[[], ContextManager] = nullcontext  # around each send (the caller's timing)

    def step(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None, *,
             forward_fn: Callable | None = None, loss_fn: Callable | None = None) -> list[torch.Tensor]:
        """Forward and backward over every microbatch; returns the unscaled per-microbatch losses
        (on the rank holding the last chunk, else ``[]``). ``inputs`` are needed on the rank of
        chunk 0, ``targets`` on the rank of the last chunk, one per microbatch. ``forward_fn`` and
        ``loss_fn``, when given, replace the constructor's for this step."""
        s = self.schedule
        self._step_forward_fn = forward_fn or self.forward_fn
        self._step_loss_fn = loss_fn or self.loss_fn
        for name, items, chunk in (("inputs", inputs, 0), ("targets", targets, s.last_chunk)):
            if chunk in self.chunks and (items is None or len(items) != s.microbatches):
                raise ValueError(f"rank {self.rank} holds chunk {chunk} and needs {s.microbatches} {name}, got {None if items is None else len(items)}")
        self.records = []
        self._inputs, self._targets = inputs, targets
        self._live: dict[tuple[int, int], _Live] = {}
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}  # hand-offs between chunks of this rank
        self._losses: dict[int, torch.Tensor] = {}
        self._comm = StageComm(s, self.rank, self.group, self.device, self.message_shape)
        self._comm.start()
        run = {"F": self._run_F, "B": self._run_B, "W": self._run_W}
        named = torch.autograd._profiler_enabled()  # ranges only under a profiler: each costs a call even unprofiled
        for action, inbox, outbox in self._plan:
            self._compute_start = None
            start = time.perf_counter()
            if named:
                with torch.profiler.record_function(f"{action.kind}{action.microbatch}.c{action.chunk}"):  # named in traces
                    run[action.kind](action, inbox, outbox)
            else:
                run[action.kind](action, inbox, outbox)
            # The record starts once the inputs are here: waiting for a message is bubble.
            self.records.append(ActionRecord(action, self._compute_start or start, time.perf_counter()))
            self._comm.poll()
        self._comm.finish()
        self._reduce_tied_grads()
        return [self._losses[m] for m in sorted(self._losses)]

    @torch.no_grad()
    def forward(self, inputs: list[torch.Tensor] | None, microbatches: int | None = None, *,
                forward_fn: Callable | None = None) -> list[torch.Tensor]:
        """Forward only (evaluation, inference): the schedule's F actions for the first
        ``microbatches`` (default ``len(inputs)``; every rank must agree), no graph, no loss.
        Returns the last chunk's outputs, one per microbatch, on its rank (else ``[]``).
        ``forward_fn``, when given, replaces the constructor's for this call."""
        s = self.schedule
        forward_fn = forward_fn or self.forward_fn
        n = len(inputs) if microbatches is None else microbatches
        if not 0 < n <= s.microbatches:
            raise ValueError(f"forward runs 1..{s.microbatches} microbatches (the schedule's), got {n}")
        fwd = make_schedule(f"{s.name}-forward", s.pp, n, s.chunk_ranks,
                            [[a for a in row if a.kind == "F" and a.microbatch < n] for row in s.ranks])
        stage, local, outputs = StageComm(fwd, self.rank, self.group, self.device), {}, {}
        stage.start()
        for a in fwd.ranks[self.rank]:
            m, c = a.microbatch, a.chunk
            message = fwd.input_message(a)
            x = inputs[m] if c == 0 else stage.recv(message) if message is not None else local.pop((m, c))
            y = forward_fn(c, self.chunks[c], x, m)
            if c == fwd.last_chunk:
                outputs[m] = y
            elif (out := fwd.output_message(a)) is not None:
                stage.send(out, y)
            else:  # the next chunk lives on this rank
                local[(m, c + 1)] = y
            stage.poll()
        stage.finish()
        return [outputs[m] for m in sorted(outputs)]

    # --- data movement -------------------------------------------------------------------------

    def _receive(self, action: Action, message: Message | None) -> torch.Tensor:
        if message is not None:
            return self._comm.recv(message)
        kind = "act" if action.kind == "F" else "grad"
        return self._local.pop((kind, action.microbatch, action.chunk))

    def _deliver(self, action: Action, message: Message | None, tensor: torch.Tensor) -> None:
        if message is not None:
            with self.send_span():
                self._comm.send(message, tensor)
        else:  # the consumer chunk lives on this rank (the bottom of a V)
            kind, to = ("act", action.chunk + 1) if action.kind == "F" else ("grad", action.chunk - 1)
            self._local[(kind, action.microbatch, to)] = tensor.detach()

    # --- actions ---------------------------------------------------------------------------------

    def _run_F(self, a: Action, inbox: Message | None, outbox: Message | None) -> None:
        m, c = a.microbatch, a.chunk
        if c == 0:
            x = self._inputs[m]
        else:
            x = self._receive(a, inbox).detach().requires_grad_(True)
        self._compute_start = time.perf_counter()
        with torch.enable_grad():
            y = self._step_forward_fn(c, self.chunks[c], x, m)
            if c == self.schedule.last_chunk:
                loss = self._step_loss_fn(y, self._targets[m])
                self._losses[m] = loss.detach()
                y = loss / self.schedule.microbatches
        self._live[(m, c)] = _Live(x, y)
        if c != self.schedule.last_chunk:
            self._deliver(a, outbox, y)
            if outbox is not None:  # sent: the send holds its own reference
                _free_storage(y)

    def _run_B(self, a: Action, inbox: Message | None, outbox: Message | None) -> None:
        m, c = a.microbatch, a.chunk
        live = self._live[(m, c)]
        if c != self.schedule.last_chunk:
            live.output = _with_grad(live.output, self._receive(a, inbox))
        self._compute_start = time.perf_counter()
        wants_input_grad = c > 0 and live.input.requires_grad
        if a.split:
            # Input grad only; the W finishes the weight grads from where B left them.
            if wants_input_grad:
                grad_in, live.pending = backward_input(live.output, live.input, self._params[c])
                self._deliver(a, outbox, grad_in)
            return
        del self._live[(m, c)]
        inputs = self._params[c] + ([live.input] if wants_input_grad else [])
        if inputs:
            torch.autograd.backward(live.output, inputs=inputs)
        if wants_input_grad:
            self._deliver(a, outbox, live.input.grad)

    def _run_W(self, a: Action, inbox: Message | None, outbox: Message | None) -> None:
        live = self._live.pop((a.microbatch, a.chunk))
        if live.pending is not None:
            backward_weight(live.pending)
        elif self._params[a.chunk]:  # no input grad was due (chunk 0): W is the whole backward
            torch.autograd.backward(live.output, inputs=self._params[a.chunk])

    def _reduce_tied_grads(self) -> None:
        if not self.tied_params or self.embedding_group is None or dist.get_world_size(self.embedding_group) == 1:
            return
        for p in self.tied_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, group=self.embedding_group)

    def timeline(self, origin: float | None = None) -> list[dict]:
        """This rank's executed actions as the simulator's JSON rows, times in seconds from ``origin``."""
        origin = self.records[0].start if origin is None and self.records else (origin or 0.0)
        return [
            {"type": r.action.kind, "microbatch": r.action.microbatch, "chunk": r.action.chunk, "split": r.action.split, "start": r.start - origin, "end": r.end - origin}
            for r in self.records
        ]
