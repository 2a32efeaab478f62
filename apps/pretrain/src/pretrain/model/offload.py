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
compute stream waits for only at first use), or at first use. A tensor saved by several nodes is
moved once; both copies go when the last node that saved it releases it (after its last backward: a
zero-bubble schedule's split backward reads a node's saved tensors in its B and again in its W, so uses
are not counted). Parameters and buffers (saved by the matmuls and
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
    """One saved tensor out of the device: its host copy, and its device copy once fetched back."""

    __slots__ = ("host", "device", "out_event", "in_event", "back")

    def __init__(self, host, device, out_event) -> None:
        self.host, self.device, self.out_event = host, device, out_event
        self.in_event, self.back = None, None


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
        key = (_address(t), t.storage_offset(), tuple(t.shape), t.stride(), t._version)
        moved = seen.get(key, (None,))[0]
        if moved is None:
            moved = self._move_out(t)
            seen[key] = (moved, t)
            moved_list.append(moved)
            self.bytes_out += t.numel() * t.element_size()
        return moved

    def _move_out(self, t: torch.Tensor) -> _Moved:
        if not self.cuda:  # a second buffer: what a host copy is on a GPU
            with host_memory():
                host = torch.empty_like(t, memory_format=torch.contiguous_format)
                host.copy_(t)
            return _Moved(host, None, None)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t is written
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        t.record_stream(self.stream)  # its memory is not reused before the copy read it
        return _Moved(host, None, event)

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
        if not isinstance(packed, _Moved):
            return packed
        self._bring_back(packed)
        if packed.in_event is not None:
            torch.cuda.current_stream(self.device).wait_event(packed.in_event)
        return packed.back
