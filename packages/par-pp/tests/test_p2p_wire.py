"""Where pipeline messages travel: gloo has no send/recv of CUDA tensors, so a CUDA pipeline over
gloo stages them through host memory; on the CPU, or with any other backend, they go as they are.
(The CUDA path itself runs in test_gpu.py, over gloo, on a GPU.)"""

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from par_pp import build_schedule
from par_pp.p2p import StageComm


def wires(devices):
    schedule = build_schedule("1f1b", 2, 4)
    return [StageComm(schedule, dist.get_rank(), dist.group.WORLD, torch.device(d)).wire.type for d in devices]


def test_gloo_stages_cuda_messages_through_host_memory(dist_run):
    # building a StageComm touches no tensor, so "cuda" can be named on this CPU-only machine
    assert dist_run(2, wires, ["cuda", "cpu"]) == [["cpu", "cpu"]] * 2


def test_other_backends_send_from_the_device():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert wires(["cuda", "meta"]) == ["cuda", "meta"]
    finally:
        dist.destroy_process_group()
