"""Each rank's fingerprints of its own forward outputs, module by module, to name the rank within its
model-parallel group where a transient fault entered (training/integrity.py).

A transient fault leaves nothing but the loss, which the tp and cp ranks of a replica share, and the
ranks after a collective all see the wrong value. So every rank keeps, during the step, one int64 per
module output per micro-batch (the sum of its bits as integers: any one flipped bit changes it), on
the device (nothing read). When a suspect's micro-batch is rerun, each rank compares its own first
run with its own rerun; the rank whose first differing output comes earliest (chunks in order, then
modules in the order they finished) is where it entered. The comparison is only meaningful with the
weights of the first run: the fingerprints are dropped when an update is applied, so only the steps
since the last applied update (a non-finite step's update is dropped under nan_policy = "skip") can
be compared; dropout would differ between a training forward and the rerun, so under dropout none is.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
RERUN = -1  # the step under which a rerun's fingerprints are kept


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bits read as integers (one int64, on its device): a flipped bit changes it."""
    flat = t.detach().contiguous().view(-1)
    return flat.view(_INT[flat.element_size()]).sum(dtype=torch.int64)


def hooked_modules(chunk: torch.nn.Module):
    """Every module of ``chunk``, but none inside a compiled forward ([train].compile: a hook there would
    break its graph): the compiled module itself is."""
    yield chunk
    if "forward" in chunk.__dict__:  # an instance's own forward: compiled (or otherwise wrapped)
        return
    for child in chunk.children():
        yield from hooked_modules(child)


def first_change(first: list[tuple[int, int]], rerun: list[tuple[int, int]]) -> tuple[int, int] | None:
    """Where this rank's rerun first differs from its first run: (chunk, index within the chunk), or None.
    Both are lists of (chunk, fingerprint) in execution order."""
    within: dict[int, int] = {}
    for i, (chunk, value) in enumerate(first):
        within[chunk] = within.get(chunk, -1) + 1
        if i >= len(rerun) or rerun[i] != (chunk, value):
            return (chunk, within[chunk])
    if len(rerun) > len(first):
        chunk = rerun[len(first)][0]
        return (chunk, within.get(chunk, -1) + 1)
    return None


def earliest(changes: dict[int, tuple[int, int] | None], suspect: int) -> int:
    """Of the suspect's replica's ranks (``changes[rank]``: where its own rerun first differed from its
    first run), the one whose change came first; the suspect where none changed."""
    changed = {r: at for r, at in changes.items() if at is not None}
    if not changed:
        return suspect
    return min(changed, key=lambda r: (changed[r], r != suspect, r))


class Fingerprints:
    """The fingerprints of this rank's forward outputs since the last applied update."""

    def __init__(self, chunks: dict[int, torch.nn.Module], on: bool) -> None:
        self.on = on
        self.kept: dict[tuple[int, int, int], list[tuple[int, torch.Tensor]]] = {}  # (step, chunk, micro)
        self.recording: list | None = None
        self.chunk = 0
        self.host_s = 0.0  # host seconds in the hooks since the last take
        self.steps: set[int] = set()
        self.last_step_values = 0  # fingerprints kept for the last step recorded
        if on:
            for c, chunk in chunks.items():
                for m in hooked_modules(chunk):
                    m.register_forward_hook(self._hook)

    def _add(self, output) -> None:
        t = output[0] if isinstance(output, (tuple, list)) and output else output
        if torch.is_tensor(t) and t.is_floating_point() and t.numel():
            start = time.perf_counter()
            self.recording.append((self.chunk, fingerprint(t)))
            self.host_s += time.perf_counter() - start

    def _hook(self, module, inputs, output) -> None:
        if self.recording is not None:  # a forward of a micro-batch (not a recompute in the backward)
            self._add(output)

    @contextmanager
    def forward(self, step: int | None, chunk: int, microbatch: int):
        """One chunk's forward of one micro-batch: its modules' outputs are recorded (none with ``step`` None)."""
        if not self.on or step is None:
            yield
            return
        self.recording, self.chunk = self.kept.setdefault((step, chunk, microbatch), []), chunk
        if step != RERUN and step not in self.steps:
            self.steps.add(step)
            self.last_step_values = 0
        try:
            yield
        finally:
            self.last_step_values += len(self.recording) if step != RERUN else 0
            self.recording = None

    def output(self, y):
        """The chunk's output as it leaves the forward (after anything done to it there), recorded last."""
        if self.recording is not None:
            self._add(y)
        return y

    def updated(self) -> None:
        """An update was applied: the fingerprints so far were taken with other weights."""
        self.kept.clear()

    def of(self, step: int, microbatch: int) -> list[tuple[int, int]] | None:
        """Step ``step``'s micro-batch's fingerprints, chunks in order, read to the host (None if not kept)."""
        keys = sorted(k for k in self.kept if k[0] == step and k[2] == microbatch)
        if not keys:
            return None
        entries = [e for k in keys for e in self.kept[k]]
        values = torch.stack([v for _, v in entries]).tolist() if entries else []
        return [(c, v) for (c, _), v in zip(entries, values)]

    def take_cost(self) -> dict:
        """Host seconds per step in the hooks and bytes kept per step, since the last take."""
        steps = max(len(self.steps), 1)
        out = {"fingerprint_s": round(self.host_s / steps, 6), "fingerprint_bytes": 8 * self.last_step_values}
        self.host_s, self.steps = 0.0, set()
        return out
