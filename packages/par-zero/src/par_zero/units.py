"""ZeRO-3 gather units: per-layer just-in-time all-gather with prefetch, released after use.

A unit is one layer (by default every child module, with ModuleList / Sequential / ModuleDict
containers expanded into their elements) plus a root unit for params no layer owns. Before a
unit's forward its buckets are gathered (usually already in flight: prefetched); after its
forward the full params are freed unless ``reshard_after_forward=False``. Hooks on the unit's
outputs fire just before its backward: they gather it again if needed. The grads' hooks free
the params once every grad of a bucket has arrived.

Prefetch: with ``overlap`` on, the next unit's gather (the previous unit's, in backward) is
launched before this unit's compute, so the two overlap (FSDP2's order). With it off, it is
launched once this unit has freed its own params: after its forward, and in backward once its
grads are all in and their reductions launched (``prefetch_prev``), one unit fewer at the peak.
On the CPU that costs little overlap (gloo runs collectives on the compute's cores) and saves
twice a unit: gloo stages a gathered output in a second buffer of its size until the gather ends.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .bucket import Bucket

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def default_unit_modules(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module``: its children, with container modules expanded recursively."""
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, CONTAINERS):
                visit(child)
            elif any(p.requires_grad for p in child.parameters()):
                units.append(child)

    visit(module)
    return units


class GatherUnit:
    """The buckets of one layer and the hooks that gather and release them."""

    def __init__(self, module: nn.Module, buckets: list[Bucket], reshard_after_forward: bool, overlap: bool):
        self.module = module
        self.buckets = buckets
        self.reshard_after_forward = reshard_after_forward
        self.overlap = overlap
        self.prev: GatherUnit | None = None
        self.next: GatherUnit | None = None

    def unshard(self) -> None:
        for b in self.buckets:
            b.unshard()

    def wait(self) -> None:
        for b in self.buckets:
            b.wait_unshard()

    def reshard(self) -> None:
        for b in self.buckets:
            b.reshard()

    def install(self, is_root: bool) -> list:
        handles = [self.module.register_forward_pre_hook(self._pre_forward)]
        handles.append(self.module.register_forward_hook(self._post_forward_root if is_root else self._post_forward))
        return handles

    def prefetch_prev(self) -> None:
        """Overlap off: this unit's grads are all in; gather the unit before it unless its backward began."""
        if not self.overlap and self.prev is not None and all(b.pending == len(b.params) for b in self.prev.buckets):
            self.prev.unshard()

    def _pre_forward(self, module, args) -> None:
        self.unshard()
        if self.overlap and self.next is not None:
            self.next.unshard()  # prefetch: overlaps with this layer's compute
        self.wait()

    def _post_forward(self, module, args, output):
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.reshard_after_forward or not tensors:
            self.reshard()
        if not self.overlap and self.next is not None:
            self.next.unshard()  # prefetch once this layer's params are freed
        for t in tensors:
            t.register_hook(self._pre_backward)
        return output

    def _post_forward_root(self, module, args, output):
        # The root unit (params no layer owns) stays gathered until its grads are in.
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad):
        self.unshard()
        if self.overlap and self.prev is not None:
            self.prev.unshard()
        self.wait()
        return None
