"""A world of any size in one process: torch's fake process group, for runs on fake tensors.

Every collective of the ``fake`` backend returns at once without moving data, so one process can
play any rank of a world of N (``pretrain plan --simulate``, tests of the real code at world 1024+).
torch ships the backend's C++ class but registers it only from a test module; :func:`fake_world`
registers it through the public ``Backend.register_backend`` and opens a default group on it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist


def _create_fake_backend(common_opts, backend_opts):
    from torch._C._distributed_c10d import FakeProcessGroup  # torch's own; not exported elsewhere

    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)


def register_fake_backend() -> None:
    """Make ``init_process_group("fake", ...)`` work (registering again replaces the entry alike)."""
    dist.Backend.register_backend("fake", _create_fake_backend, extended_api=True, devices=["cpu", "cuda"])


@contextmanager
def fake_world(rank: int, world_size: int):
    """The default process group as rank ``rank`` of a fake world of ``world_size``; destroyed on exit."""
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
