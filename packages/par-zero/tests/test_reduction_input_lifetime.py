"""ZeRO-2/3 drop the full gradient buffer once its reduce-scatter is launched: on the CPU (gloo) at
once, on CUDA only after the work's wait() (the communicator reads it on its own stream after the
call returns). Checked with a stand-in collective that keeps no reference to its input, on fake
CUDA tensors and torch's fake process group."""

import gc
import weakref
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from par_zero import bucket as bucket_module
from par_zero.bucket import Bucket
from par_zero.bucket_groups import BucketGroups
from par_zero.config import DataParallelConfig


class PendingWork:
    def __init__(self):
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.done = True
        return True


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_full_grad_lives_until_the_wait_on_cuda_only(fake_world, monkeypatch, device, strategy):
    works = []

    def reduce_scatter_tensor(output, input, group, async_op=False, spare_memory=False):
        works.append(PendingWork())  # holds nothing: what keeps the input alive is the bucket alone
        return works[-1]

    monkeypatch.setattr(bucket_module.comm, "reduce_scatter_tensor", reduce_scatter_tensor)
    with FakeTensorMode(allow_non_fake_inputs=True) if device == "cuda" else nullcontext():
        params = [nn.Parameter(torch.randn(6, 4, device=device)), nn.Parameter(torch.randn(5, device=device))]
        b = Bucket(params, BucketGroups(dist.group.WORLD), DataParallelConfig(strategy))
        b.new_full_grad()
        full = weakref.ref(b.full_grad)
        b.launch_reduce()
        gc.collect()
        assert b.full_grad is None and works and not works[0].done
        if device == "cpu":
            assert full() is None  # gloo: freed while backward runs
        else:
            assert full() is not None  # CUDA: still referenced while the collective may read it
            assert b.try_finish(block=False) is False and full() is not None
            assert b.try_finish(block=True) is True and works[0].done
            gc.collect()
            assert full() is None  # released by the wait
        assert b.opt_grad.shape == (b.S,)
