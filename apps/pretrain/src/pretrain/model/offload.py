"""``[model].offload``: chosen modules' saved activations held in host memory between their forward and
their backward.

Items: ``attn`` (the attention block), ``mlp`` (a dense MLP), ``moe`` (a MoE layer), ``layernorm``
(both norms of a layer), ``layer`` (the whole decoder layer), each for every layer or ``name@first-last``
(global layer indices), and ``layers:N``: the whole first N decoder layers of each model chunk (the
ones whose activations wait longest for their backward under 1F1B).

A region runs under saved-tensor hooks (:class:`Offloader`): each tensor autograd saves in it is
copied out when saved (on CUDA to pinned host memory, on a side stream after the compute stream's
work that made it; on the CPU to a second buffer, so that the same code and its byte counts are
tested there) and its device copy dropped; it is copied back when the region's backward is about
to run (the gradient of the region's output arriving: a prefetch on the side stream, which the
compute stream waits for only at first use), or at first use. What moves is memory, not tensors: the
span of its storage a saved tensor covers, once for every view inside it (an attention's output, saved
by its kernel and, reshaped, by the output projection, is one storage: the device frees it once), each
view rebuilt on the copy back; both copies go when the last node that saved one of its views releases
it (after its last backward: a zero-bubble schedule's split backward reads a node's saved tensors in its
B and again in its W, so uses are not counted). Parameters and buffers (saved by the matmuls and
RoPE) stay where they are. Nothing here reads a device value: no host synchronisation.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn


# Where the host copies are made: a context the fake-tensor memory tracker (plan --simulate) replaces with
# its own, which does not count them as the device's
host_memory = contextlib.nullcontext


@contextlib.contextmanager
def host_copies(context):
    """Make the host copies inside ``context()`` while this lasts."""
    global host_memory
    outer, host_memory = host_memory, context
    try:
        yield
    finally:
        host_memory = outer

def _address(t: torch.Tensor) -> int:
    """Its storage's address (the same memory saved by several nodes, as one view or another), or on fake
    tensors, which have none, the storage object's id (``region`` holds the tensors, so their storages:
    neither is reused in it)."""
    storage = t.untyped_storage()
    try:
        return storage.data_ptr() or id(storage)
    except RuntimeError:
        return id(storage)


class _Region(list):
    """One region's moved tensors, and a weak reference to the region before it (``before``)."""

    before = None


class _Moved:
    """One span of a storage out of the device (elements ``start`` to ``end`` of it, as its saved
    tensors' dtype): its host copy, and its device copy once fetched back."""

    __slots__ = ("host", "device", "out_event", "in_event", "back", "start", "end", "version")

    def __init__(self, host, device, out_event, start: int = 0, end: int = 0, version: int = 0) -> None:
        self.host, self.device, self.out_event = host, device, out_event
        self.in_event, self.back = None, None
        self.start, self.end, self.version = start, end, version


class _View:
    """A saved tensor as a view of a moved span: what its node holds (and so the span)."""

    __slots__ = ("moved", "shape", "stride", "offset")

    def __init__(self, moved: _Moved, t: torch.Tensor) -> None:
        self.moved, self.shape, self.stride = moved, tuple(t.shape), t.stride()
        self.offset = t.storage_offset() - moved.start


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The elements of its storage ``t`` reads: [first, last + 1)."""
    start = t.storage_offset()
    return start, start + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


class Offloader:
    """Saved-tensor hooks moving one device's saved activations out and back; counts the bytes."""

    def __init__(self) -> None:
        self.device, self.cuda, self.stream = None, False, None
        self.bytes_out = 0  # host-side ints (shapes and dtypes only: no device read)
        self.bytes_in = 0
        self._region: tuple | None = None
        self._last = None  # the last region's moved tensors (a weak reference)

    @contextlib.contextmanager
    def region(self, module: nn.Module, device: torch.device):
        """Saved tensors of the code inside (``module``'s forward on ``device``) go out, not its parameters
        and buffers (as they are now: ZeRO-3's gathered ones included); yields the list of moved tensors."""
        if self.device is None:
            self.device, self.cuda = device, device.type == "cuda"
            self.stream = torch.cuda.Stream(device) if self.cuda else None
        moved = _Region()
        moved.before = self._last  # the region whose backward comes after this one's: prefetched with it
        self._last = weakref.ref(moved)
        seen: dict = {}  # also holds each moved tensor until the region ends: its address is not reused in it
        kept = {id(t) for t in (*module.parameters(), *module.buffers())}  # (storage addresses: none on fake tensors)
        outer, self._region = self._region, (moved, seen, kept)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield moved
        finally:
            self._region = outer

    def prefetch_on_grad(self, out: torch.Tensor, moved: "_Region") -> torch.Tensor:
        """Start bringing ``moved`` back when ``out``'s gradient arrives (its backward is next), and the
        region before it, whose backward follows (its copies then overlap this region's backward)."""
        if moved and out.requires_grad:
            def hook(grad):
                self._prefetch(moved)
                before = moved.before() if moved.before is not None else None
                if before is not None:
                    self._prefetch(before)
                # the graph keeps this hook to the step's end: only the nodes that saved them keep the copies
                moved.clear()
            out.register_hook(hook)
        return out

    def _keep(self, t: torch.Tensor) -> bool:
        kept = self._region[2]
        return (t.device != self.device or not t.is_floating_point() or t.numel() == 0 or isinstance(t, nn.Parameter)
                or id(t) in kept or (t._base is not None and id(t._base) in kept))

    def _pack(self, t: torch.Tensor):
        if self._keep(t):
            return t
        moved_list, seen, _ = self._region
        start, end = _span(t)
        spans = seen.setdefault((_address(t), t.dtype), [])
        moved = next((m for m, _ in spans if m.start <= start and end <= m.end and m.version == t._version), None)
        if moved is None:  # a storage's first saved span, or one beyond those moved (or written since)
            moved = self._move_out(t, start, end)
            spans.append((moved, t))
            moved_list.append(moved)
            self.bytes_out += (end - start) * t.element_size()
        return _View(moved, t)

    def _move_out(self, t: torch.Tensor, start: int, end: int) -> _Moved:
        span = t.as_strided((end - start,), (1,), start)
        if not self.cuda:  # a second buffer: what a host copy is on a GPU
            with host_memory():
                host = torch.empty_like(span)
                host.copy_(span)
            return _Moved(host, None, None, start, end, t._version)
        host = torch.empty(span.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written
        with torch.cuda.stream(self.stream):
            host.copy_(span, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        t.record_stream(self.stream)  # its memory is not reused before the copy read it
        return _Moved(host, None, event, start, end, t._version)

    def _bring_back(self, moved: _Moved) -> None:
        if moved.back is not None:
            return
        if moved.host is None:
            raise RuntimeError("offload: a saved tensor was freed before its last use in the backward")
        self.bytes_in += moved.host.numel() * moved.host.element_size()
        if not self.cuda:  # the copy back: device memory again
            moved.back = moved.host.clone()
            return
        with torch.cuda.stream(self.stream):  # memory of the side stream's: no wait for the compute stream
            back = torch.empty(moved.host.shape, dtype=moved.host.dtype, device=self.device)
            back.copy_(moved.host, non_blocking=True)  # after its copy out: the same stream
            moved.in_event = torch.cuda.Event()
            moved.in_event.record(self.stream)
        back.record_stream(torch.cuda.current_stream(self.device))  # the backward reads it there
        moved.back = back

    def _prefetch(self, moved: list) -> None:
        for m in moved:
            if m.host is not None:
                self._bring_back(m)

    def _unpack(self, packed):
        if not isinstance(packed, _View):
            return packed
        moved = packed.moved
        self._bring_back(moved)
        if moved.in_event is not None:
            torch.cuda.current_stream(self.device).wait_event(moved.in_event)
        return moved.back.as_strided(packed.shape, packed.stride, packed.offset)
