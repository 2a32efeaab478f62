"""The one thin layer every package sends collectives through, so communication can be counted.

Each call records ``(op, group_size, bytes)`` into every active :class:`CommRecorder`.
``bytes`` is the size of the logical tensor the operation works on: all-reduce its tensor,
all-gather the gathered output, reduce-scatter the unreduced input, all-to-all this rank's
input, send/recv the message, a barrier nothing, the object collectives the pickled objects
(all-gather: group size x this rank's). ``wire_bytes`` gives what a ring algorithm actually puts on the
wire per rank: there a reduce-scatter plus an all-gather of one tensor move exactly what one
all-reduce of it moves, as the theory says. An all-to-all records exactly the bytes it sends to
other ranks (``sent``, from its split sizes), which is its ``wire_bytes``.

The active recorders live in a ContextVar (per thread / task), not in module globals. So does the
active :class:`~par_groups.watch.CommWatch`, which times each call's wait and keeps a flight
recorder of the last ones (see :mod:`par_groups.watch`). Inside a region torch.compile traces,
neither sees the call (it becomes a functional collective in the graph, with no graph break);
the watch records the compiled region as a whole (``CommWatch.region``).
"""

from __future__ import annotations

import pickle
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from .watch import active_watch

_recorders: ContextVar[tuple["CommRecorder", ...]] = ContextVar("par_comm_recorders", default=())


@dataclass(frozen=True)
class CommRecord:
    op: str
    group_size: int
    bytes: int
    group: ProcessGroup | None = field(default=None, compare=False, repr=False)  # which group (None: world)
    sent: int | None = field(default=None, compare=False)  # all-to-all: bytes this rank sent to other ranks
    dtype: str | None = field(default=None, compare=False)  # the moved tensor's dtype ("float8_e4m3fn", ...)

    def __reduce__(self):  # a ProcessGroup lives in one process: records sent to another drop it
        return (CommRecord, (self.op, self.group_size, self.bytes, None, self.sent, self.dtype))

    @property
    def wire_bytes(self) -> int:
        """Bytes each rank sends with ring algorithms (all-reduce 2(n-1)/n, gather/scatter (n-1)/n)."""
        n = self.group_size
        if n <= 1:
            return 0
        if self.sent is not None:
            return self.sent
        if self.op == "all_reduce":
            return 2 * (n - 1) * self.bytes // n
        if self.op in ("all_gather", "all_gather_object", "reduce_scatter", "all_to_all"):
            return (n - 1) * self.bytes // n
        return self.bytes


@dataclass
class CommRecorder:
    """Context manager collecting every collective issued through this module inside it."""

    records: list[CommRecord] = field(default_factory=list)

    def __enter__(self) -> "CommRecorder":
        self._token = _recorders.set(_recorders.get() + (self,))
        return self

    def __exit__(self, *exc) -> None:
        _recorders.reset(self._token)

    def ops(self) -> list[str]:
        return [r.op for r in self.records]

    def count(self, op: str) -> int:
        return sum(r.op == op for r in self.records)

    def total_bytes(self, op: str | None = None) -> int:
        return sum(r.bytes for r in self.records if op is None or r.op == op)

    def bytes_by_dtype(self, op: str | None = None) -> dict[str | None, int]:
        """Bytes of the recorded collectives [of one op] per dtype moved (None: object collectives, barriers)."""
        out: dict[str | None, int] = {}
        for r in self.records:
            if op is None or r.op == op:
                out[r.dtype] = out.get(r.dtype, 0) + r.bytes
        return out


def _record(op: str, group: ProcessGroup | None, nbytes: int, sent: int | None = None,
            tensor: torch.Tensor | None = None) -> None:
    recorders = _recorders.get()
    if recorders and not torch.compiler.is_compiling():  # traced: dynamo keeps no Python side effect
        dtype = None if tensor is None else str(tensor.dtype).removeprefix("torch.")
        rec = CommRecord(op, dist.get_world_size(group), int(nbytes), group, sent, dtype)
        for r in recorders:
            r.records.append(rec)


def _call(op: str, group: ProcessGroup | None, nbytes: int, call, async_op: bool, peer: int | None = None,
          tensor: torch.Tensor | None = None):
    """``call()`` (the torch collective), timed and recorded by the active watch if there is one.
    ``tensor``: one of its tensors (a CUDA one is timed on the stream; see ``CommWatch.stamp``)."""
    watch = active_watch()
    if watch is None or torch.compiler.is_compiling():  # traced into the graph; the watch records the
        return call()  # compiled region around it as one entry (CommWatch.region), outside the trace
    cuda = tensor is not None and tensor.device.type == "cuda"
    return watch.run(watch.begin(op, group, nbytes, peer), call, async_op, cuda)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op=ReduceOp.SUM, async_op: bool = False):
    _record("all_reduce", group, _nbytes(tensor), tensor=tensor)
    return _call("all_reduce", group, _nbytes(tensor),
                 lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), async_op, tensor=tensor)


def _on_wire(*tensors: torch.Tensor, group: ProcessGroup | None) -> tuple[torch.Tensor, ...]:
    """FP8 tensors as their bytes where the backend has no FP8 type (gloo): a gather or an all-to-all only
    moves bytes. Records keep the tensor's own dtype."""
    if tensors[0].element_size() == 1 and tensors[0].is_floating_point() and _is_gloo(group):
        return tuple(t.view(torch.uint8) for t in tensors)
    return tensors


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, async_op: bool = False):
    _record("all_gather", group, _nbytes(output), tensor=output)
    output, input = _on_wire(output, input, group=group)
    return _call("all_gather", group, _nbytes(output),
                 lambda: dist.all_gather_into_tensor(output, input, group=group, async_op=async_op), async_op,
                 tensor=input)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, op=ReduceOp.SUM,
                          async_op: bool = False, spare_memory: bool = False):
    """Rank i's ``output`` = the sum over ranks of block i of ``input`` (blocks of ``output``'s size).

    On gloo a sum is an all-to-all and a local sum (:func:`_reduce_scatter_by_all_to_all`): gloo's own
    reduce-scatter is an all-reduce followed by a copy of the block, twice the bytes and slower
    (tools/bench/gloo_reduce_scatter.py).
    That holds a transient buffer of the input's size until the wait; ``spare_memory=True`` (ZeRO-2/3,
    whose point is memory) keeps gloo's own."""
    _record("reduce_scatter", group, _nbytes(input), tensor=input)
    if op == ReduceOp.SUM and not spare_memory and _is_gloo(group):
        return _reduce_scatter_by_all_to_all(output, input, group, async_op)
    return _call("reduce_scatter", group, _nbytes(input),
                 lambda: dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op), async_op,
                 tensor=input)


def _is_gloo(group: ProcessGroup | None) -> bool:
    return dist.get_backend(group) == dist.Backend.GLOO


class _ThenWork:
    """An asynchronous collective's work followed by a local step, run once, at the first ``wait()``."""

    def __init__(self, work, then) -> None:
        self._work, self._then = work, then

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self, *args, **kwargs) -> bool:
        out = self._work.wait(*args, **kwargs)
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return out

    def __getattr__(self, name):  # exception, source rank ... as the work has them
        return getattr(self._work, name)


def _reduce_scatter_by_all_to_all(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None,
                                  async_op: bool):
    """Reduce-scatter as one all-to-all (rank j gets block j of every rank: (n-1)/n of the input
    leaves each rank, what a ring reduce-scatter sends) and a local sum of the n blocks, in rank
    order. The received blocks are a transient buffer of the input's size."""
    n = dist.get_world_size(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter_tensor: input of {input.numel()} elements is not {n} x the output's "
                         f"{output.numel()}")
    received = torch.empty_like(input, memory_format=torch.contiguous_format)
    work = _call("reduce_scatter", group, _nbytes(input), lambda: dist.all_to_all_single(
        received, input.contiguous(), group=group, async_op=async_op), async_op, tensor=input)

    def sum_blocks() -> None:
        torch.sum(received.view(n, -1), dim=0, out=output.view(-1))
    if not async_op:
        sum_blocks()
        return None
    return _ThenWork(work, sum_blocks)


def _sent_off_rank(input: torch.Tensor, group: ProcessGroup | None, input_split_sizes: list[int] | None) -> int:
    """Bytes of ``input`` that leave this rank: all but the split it sends to itself."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if input_split_sizes is None:
        return _nbytes(input) * (n - 1) // n
    row = _nbytes(input) // max(input.shape[0], 1)
    return row * (sum(input_split_sizes) - input_split_sizes[me])


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    async_op: bool = False,
):
    _record("all_to_all", group, _nbytes(input), _sent_off_rank(input, group, input_split_sizes), tensor=input)
    output, input = _on_wire(output, input, group=group)
    return _call("all_to_all", group, _nbytes(input), lambda: dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op), async_op, tensor=input)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, async_op: bool = False):
    _record("broadcast", group, _nbytes(tensor), tensor=tensor)
    return _call("broadcast", group, _nbytes(tensor),
                 lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op), async_op, tensor=tensor)


def batch_isend_irecv(ops: list[dist.P2POp]):
    """Batched point-to-point; records each send (receives are the peers' sends). The watch sees
    one entry per batch: a ``send`` or ``recv`` with the first op's peer (global rank)."""
    for p2p in ops:
        if p2p.op is dist.isend:
            _record("send", p2p.group, _nbytes(p2p.tensor), tensor=p2p.tensor)
    first = ops[0]
    kind = "send" if first.op is dist.isend else "recv"
    return _call(kind, first.group, sum(_nbytes(p.tensor) for p in ops), lambda: dist.batch_isend_irecv(ops), True,
                 first.peer, first.tensor)  # P2POp's peer is a global rank


def barrier(group: ProcessGroup | None) -> None:
    """Every rank of ``group`` waits for the others (recorded with 0 bytes)."""
    _record("barrier", group, 0)
    _call("barrier", group, 0, lambda: dist.barrier(group=group), False)


def _pickled(obj) -> int:
    return len(pickle.dumps(obj))  # the bytes torch's object collectives send for it (they pickle it too)


def all_gather_object(output: list, obj, group: ProcessGroup | None) -> None:
    """``output[i]`` = rank i's ``obj`` (picklable). Recorded as group size x this rank's pickled size."""
    nbytes = dist.get_world_size(group) * _pickled(obj)
    _record("all_gather_object", group, nbytes)
    _call("all_gather_object", group, nbytes, lambda: dist.all_gather_object(output, obj, group=group), False)


def gather_object(obj, output: list | None, dst: int, group: ProcessGroup | None) -> None:
    """Every rank's ``obj`` into ``output`` on global rank ``dst`` (None elsewhere). Recorded as what
    this rank sends: its pickled ``obj``, nothing on ``dst``."""
    nbytes = 0 if dist.get_rank() == dst else _pickled(obj)
    _record("gather_object", group, nbytes)
    _call("gather_object", group, nbytes, lambda: dist.gather_object(obj, output, dst=dst, group=group), False)
