"""A recorder of every op that makes a host (CPU) tensor: how tests prove that device follows the
data on fake CUDA or meta tensors, where any CPU output is a tensor left behind on the host."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class CpuOutputs(TorchDispatchMode):
    """``with CpuOutputs() as rec: ...`` then ``rec.ops``: the ops whose output is a CPU tensor."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_leaves(out)):
            self.ops.append(str(func))
        return out
