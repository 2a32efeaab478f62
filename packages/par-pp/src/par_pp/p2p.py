"""Point-to-point streams between pipeline ranks, with shapes sent at run time.

Each message is a small int64 header (dtype, ndim, dims) followed by the payload. Between one
pair of ranks, messages match in the order they are posted (NCCL's rule, and gloo's for one
tag), so the receiver posts its receives in the *sender's* send order, which the schedule
tells it, even when it consumes them in another order. To overlap transfers with compute, the
next header of every incoming stream is posted ahead of time, and its payload receive as soon
as the header has landed; with declared shapes (no headers), the next ``POSTED_AHEAD``
receives. Everything goes through ``par_groups.comm.batch_isend_irecv``.

gloo cannot send or receive CUDA tensors (only its collectives take them), so over gloo a CUDA
pipeline stages its messages through host memory; NCCL sends them from the GPU.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from par_groups import comm

from .ir import Message

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_MAX_DIMS = 8
_HEADER_LEN = 2 + _MAX_DIMS
# Receives posted ahead per incoming stream when shapes are declared. Two: a DualPipeV F&B pair,
# or a V / interleaved rank's back-to-back F and B, takes both its inputs from one peer, so the
# second receive is posted before the first is waited on and its message lands while the first
# one's compute runs (tools/bench/bench_pp.py); 1F1B has one kind of message per stream.
POSTED_AHEAD = 2


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
        raise ValueError(f"cannot send a {t.dtype} tensor with {t.dim()} dims between stages; use one of {_DTYPES}, at most {_MAX_DIMS} dims")
    dims = list(t.shape) + [0] * (_MAX_DIMS - t.dim())
    return torch.tensor([_DTYPES.index(t.dtype), t.dim(), *dims], dtype=torch.int64, device=t.device)


def _empty_from_header(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    code, ndim, *dims = h.tolist()
    return torch.empty(dims[:ndim], dtype=_DTYPES[code], device=device)


class _Incoming:
    """One peer's messages to this rank, received strictly in the peer's send order."""

    def __init__(self, expected: list[Message], peer: int, group: ProcessGroup, device: torch.device, fixed,
                 wire: torch.device):
        self.expected, self.peer, self.group, self.device, self.fixed = expected, peer, group, device, fixed
        self.wire = wire  # where the receive buffers live (host memory for gloo with CUDA)
        self.next = 0  # index in `expected` of the next message whose header is not yet posted
        self.header: tuple[torch.Tensor, list] | None = None  # the posted header, if any
        self.payloads: dict[Message, tuple[torch.Tensor, list]] = {}  # posted, not yet taken

    def _post(self, tensor: torch.Tensor) -> list:
        return comm.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, self.peer, self.group)])

    def pump(self, block: bool) -> None:
        """Post the next header; once it has arrived, post its payload (blocking if ``block``)."""
        if self.fixed is not None:  # no header: every message has the declared shape and dtype
            # up to POSTED_AHEAD receives in flight (a bounded number: each holds a buffer)
            while self.next < len(self.expected) and (block or len(self.payloads) < POSTED_AHEAD):
                payload = torch.empty(self.fixed[0], dtype=self.fixed[1], device=self.wire)
                self.payloads[self.expected[self.next]] = (payload, self._post(payload))
                self.next += 1
                if block:
                    return
            return
        if self.header is None and self.next < len(self.expected):
            buf = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.wire)
            self.header = (buf, self._post(buf))
        if self.header is None:
            return
        buf, works = self.header
        if not block and not all(w.is_completed() for w in works):
            return
        for w in works:
            w.wait()
        payload = _empty_from_header(buf, self.wire)
        self.payloads[self.expected[self.next]] = (payload, self._post(payload))
        self.next += 1
        self.header = None

    def take(self, message: Message) -> torch.Tensor:
        while message not in self.payloads:
            if self.next >= len(self.expected):
                raise RuntimeError(f"{message} is not among the messages expected from rank {self.peer}")
            self.pump(block=True)
        payload, works = self.payloads.pop(message)
        for w in works:
            w.wait()
        self.pump(block=False)  # keep the next header in flight
        return payload.to(self.device)


class StageComm:
    """This rank's sends and receives for one step of a schedule.

    ``fixed = (shape, dtype)`` declares every message's shape (Megatron's fixed ``tensor_shape``):
    no headers are exchanged, and a receiver never needs a value to size its buffer."""

    def __init__(self, schedule, rank: int, group: ProcessGroup, device: torch.device, fixed=None):
        self.group, self.fixed = group, fixed
        device = torch.device(device)
        self.wire = torch.device("cpu") if device.type == "cuda" and dist.get_backend(group) == "gloo" else device
        self._global = [dist.get_global_rank(group, r) for r in range(schedule.pp)]
        by_src: dict[int, list[Message]] = {}
        for src in range(schedule.pp):
            for m in schedule.sends(src):
                if m.dst == rank:
                    by_src.setdefault(src, []).append(m)
        self.incoming = {src: _Incoming(msgs, self._global[src], group, device, fixed, self.wire)
                         for src, msgs in by_src.items()}
        self.pending_sends: deque = deque()

    def start(self) -> None:
        for stream in self.incoming.values():
            stream.pump(block=False)

    def poll(self) -> None:
        """Advance every stream without blocking, so payload receives get posted early; let go of
        sends that have completed (their buffers would otherwise live until the step ends).
        Sends complete roughly in order: only the oldest are checked, so a poll costs O(1), not
        O(sends in flight)."""
        for stream in self.incoming.values():
            stream.pump(block=False)
        sends = self.pending_sends
        while sends and all(w.is_completed() for w in sends[0][1]):
            sends.popleft()

    def recv(self, message: Message) -> torch.Tensor:
        return self.incoming[message.src].take(message)

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to(self.wire).contiguous()
        peer = self._global[message.dst]
        if self.fixed is not None and (tuple(tensor.shape), tensor.dtype) != (tuple(self.fixed[0]), self.fixed[1]):
            raise ValueError(f"{message}: tensor {tuple(tensor.shape)} {tensor.dtype} differs from the declared "
                             f"message shape {tuple(self.fixed[0])} {self.fixed[1]}")
        ops = [dist.P2POp(dist.isend, tensor, peer, self.group)]
        if self.fixed is None:
            ops.insert(0, dist.P2POp(dist.isend, _header(tensor), peer, self.group))
        self.pending_sends.append((ops, comm.batch_isend_irecv(ops)))  # keep the buffers alive until waited

    def finish(self) -> None:
        for _, works in self.pending_sends:
            for w in works:
                w.wait()
        self.pending_sends.clear()
        leftover = {src: s.expected[s.next :] for src, s in self.incoming.items() if s.next < len(s.expected) or s.payloads}
        if leftover:
            raise RuntimeError(f"messages never received: {leftover}")
