"""Live bytes of every tensor storage a simulated rank allocates, by category, with the peak.

A dispatch mode above ``FakeTensorMode`` sees every op's outputs; each new storage is counted
under the current phase (``tracker.phase``) until it is freed (a weakref finalizer). At a phase
boundary, :meth:`retag` moves storages that are known model state (parameters, gradients,
optimizer buffers) into their own categories. Scalar reads (``.item()``), which fake tensors
cannot answer, return 1: the simulation never branches on a value it could not have known.
"""

from __future__ import annotations

import contextlib

import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# "activations" are everything the step allocates beyond model state (saved tensors and the
# temporaries alive with them); "other" is what construction left that is not model state.
CATEGORIES = ("params", "grads", "optim", "activations", "other", "save")


class MemoryTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = "other"
        self.live: dict[int, list] = {}  # key -> [bytes, category, weakref]
        self.current: dict[str, int] = defaultdict(int)
        self.total = 0
        self.peak = 0
        self.peak_by: dict[str, int] = {}
        self.largest: dict[str, int] = defaultdict(int)  # largest single storage per category
        self._next = 0
        self.hosting = False  # inside host_memory(): what is made is host memory, not the device's

    @contextlib.contextmanager
    def host_memory(self):
        """Tensors made inside are host memory (offload.py's copies out): not counted."""
        outer, self.hosting = self.hosting, True
        try:
            yield
        finally:
            self.hosting = outer

    # ---- counting ----------------------------------------------------------------------------
    def _free(self, key: int) -> None:
        nbytes, cat = self.live.pop(key)[:2]
        self.current[cat] -= nbytes
        self.total -= nbytes

    def _add(self, st: torch.UntypedStorage, category: str) -> None:
        key = self._next
        self._next += 1
        nbytes = st.nbytes()
        ref = weakref.ref(st, lambda _, k=key: self._free(k) if k in self.live else None)
        self.live[key] = [nbytes, category, ref]
        st._par_sim_key = key
        self.current[category] += nbytes
        self.total += nbytes
        self.largest[category] = max(self.largest[category], nbytes)
        if self.total > self.peak:
            self.peak, self.peak_by = self.total, dict(self.current)

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if self.hosting or getattr(st, "_par_sim_host", False):  # host memory ([model].offload's copies)
            st._par_sim_host = True
            return
        key = getattr(st, "_par_sim_key", None)
        if key is None or key not in self.live:
            self._add(st, self.phase)
            return
        entry = self.live[key]
        if st.nbytes() != entry[0]:  # resized in place (ZeRO-3 frees and re-gathers params this way)
            delta = st.nbytes() - entry[0]
            entry[0] += delta
            self.current[entry[1]] += delta
            self.total += delta
            if self.total > self.peak:
                self.peak, self.peak_by = self.total, dict(self.current)

    def retag(self, tensors: dict[str, list[torch.Tensor]]) -> None:
        """Count the storages of ``tensors`` ({category: [tensor]}) under that category from now on."""
        for category, ts in tensors.items():
            for t in ts:
                if t is None:
                    continue
                self.track(t)
                entry = self.live[t.untyped_storage()._par_sim_key]
                self.current[entry[1]] -= entry[0]
                entry[1] = category
                self.current[category] += entry[0]
                self.largest[category] = max(self.largest[category], entry[0])

    def reset_peak(self) -> None:
        self.peak, self.peak_by = self.total, dict(self.current)

    def snapshot(self) -> dict:
        return {"peak": self.peak, "by_category": {c: self.peak_by.get(c, 0) for c in CATEGORIES}}

    # ---- dispatch ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        if func is torch.ops.aten.resize_.default or "resize" in func.__name__:
            for t in tree_leaves(args):
                if isinstance(t, torch.Tensor):
                    self.track(t)
        return out
