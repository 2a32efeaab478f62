"""Count the bytes of the collectives a torch peer issues (DTensor, FSDP2, pipelining, context parallel).

torch's ``CommDebugMode`` sees every c10d and functional collective as it is dispatched, but
counts calls only, and its module tracker breaks ``autograd.grad(inputs=...)`` (torch's
zero-bubble schedules). ``TorchCommBytes`` is the same dispatch mode without the tracker,
recording a ``par_groups.CommRecord`` per call, with the same byte convention as ours (all-gather: the gathered output; reduce-scatter: the
unreduced input; all-reduce: the tensor; all-to-all: the input, ``sent`` the off-rank splits;
send: the message), so ``wire_bytes`` compares the two sides on one rule:

    with TorchCommBytes() as peer_comm:
        peer_step()
    peer_comm.wire_bytes(), peer_comm.ops()
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from par_groups import CommRecord

# op name (c10d in-place ops and the native functional ones) -> (kind, where its counted bytes are)
_OPS = {
    "_allgather_base_": ("all_gather", "out0"), "allgather_": ("all_gather", "out0"),
    "allgather_into_tensor_coalesced_": ("all_gather", "out0"), "all_gather_into_tensor": ("all_gather", "in0xn"),
    "all_gather_into_tensor_coalesced": ("all_gather", "in0xn"),
    "_reduce_scatter_base_": ("reduce_scatter", "in1"), "reduce_scatter_": ("reduce_scatter", "in1"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "in1"), "reduce_scatter_tensor": ("reduce_scatter", "in0"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in0"),
    "allreduce_": ("all_reduce", "in0"), "allreduce_coalesced_": ("all_reduce", "in0"), "all_reduce": ("all_reduce", "in0"),
    "all_reduce_coalesced": ("all_reduce", "in0"),
    "alltoall_base_": ("all_to_all", "in1"), "all_to_all_single": ("all_to_all", "in0"),
    "broadcast_": ("broadcast", "in0"), "broadcast": ("broadcast", "in0"), "send": ("send", "in0"),
}
_NAMESPACES = ("c10d", "_c10d_functional")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def _group(args):
    """The process group of a c10d op (an argument, boxed as a ScriptObject) or a functional one (its name)."""
    for a in args:
        if isinstance(a, ProcessGroup):
            return a
        if isinstance(a, torch.ScriptObject):
            return ProcessGroup.unbox(a)
    return _resolve_process_group([a for a in args if isinstance(a, str)][-1])


def _record(kind: str, where: str, args) -> CommRecord:
    pg = _group(args)
    n = pg.size()
    nbytes = {"out0": lambda: _nbytes(args[0]), "in0": lambda: _nbytes(args[0]), "in1": lambda: _nbytes(args[1]),
              "in0xn": lambda: _nbytes(args[0]) * n}[where]()
    sent = None
    if kind == "all_to_all":  # c10d (output, input, pg, out_splits, in_splits, ..); functional (input, out_splits, in_splits, name)
        inp, splits = (args[1], args[4]) if where == "in1" else (args[0], args[2])
        row = _nbytes(inp) // max(inp.shape[0], 1)
        sent = row * (sum(splits) - splits[pg.rank()]) if splits else _nbytes(inp) * (n - 1) // n
    return CommRecord(kind, n, nbytes, None, sent)


class TorchCommBytes(TorchDispatchMode):
    """Records a CommRecord (op, group size, bytes) per collective call dispatched inside it."""

    supports_higher_order_operators = True  # flex-attention: run it, it is no collective

    def __init__(self):
        super().__init__()
        self.records: list[CommRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower itself to the collectives it issues (as CommDebugMode does)
        out = func(*args, **(kwargs or {}))
        ns, _, name = str(func._overloadpacket).partition(".")
        if ns in _NAMESPACES and name in _OPS:
            self.records.append(_record(*_OPS[name], args))
        return out

    def wire_bytes(self) -> int:
        return sum(r.wire_bytes for r in self.records)

    def ops(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            counts[r.op] = counts.get(r.op, 0) + 1
        return counts
