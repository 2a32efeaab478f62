"""CUDA: the pipeline executor on two ranks sharing one GPU (1F1B) equals one CPU process (fp32).

The two ranks talk over gloo, which has no send/recv of CUDA tensors: the stages' messages go
through host memory (par_pp.p2p's ``wire``), the same code NCCL runs on a multi-GPU machine
but for that one copy.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from par_groups.testing.gpu import gpu_device, rel_error
from par_pp import PipelineExecutor, build_schedule, chunks_on_rank, split_layers

pytestmark = pytest.mark.gpu
H, V, S, B, M, LAYERS = 64, 32, 16, 2, 4, 4
FP32_TOL = 1e-5  # fp32 on both sides; only accumulation order differs (~1e-7)


def model(seed=0):
    torch.manual_seed(seed)
    return [nn.Embedding(V, H)] + [nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(LAYERS)] + [nn.Linear(H, V)]


def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (S, B), generator=g) for _ in range(M)], [torch.randint(0, V, (S, B), generator=g) for _ in range(M)]


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def pipeline_grads(device: str):
    if device == "cuda":
        torch.cuda.set_device(0)
    rank, parts = dist.get_rank(), model()
    schedule = build_schedule("1f1b", 2, M)
    ranges = split_layers(len(parts), schedule.num_chunks)
    chunks = {c: nn.Sequential(*(parts[i] for i in ranges[c])).to(device) for c in chunks_on_rank(schedule, rank)}
    inputs, targets = data()
    executor = PipelineExecutor(schedule, chunks, dist.group.WORLD, loss_fn=loss_fn, device=device)
    losses = executor.step([x.to(device) for x in inputs], [y.to(device) for y in targets])
    grads = {f"{c}.{n}": p.grad.cpu() for c, ch in chunks.items() for n, p in ch.named_parameters()}
    return {"losses": [l.detach().cpu() for l in losses or []], "grads": grads}


def single_process_grads():
    parts = model()
    net = nn.Sequential(*parts)
    inputs, targets = data()
    losses = [loss_fn(net(x), y) for x, y in zip(inputs, targets)]
    (sum(losses) / M).backward()
    return losses, parts


def test_two_stage_pipeline_on_gpu_matches_cpu(dist_run):
    device = gpu_device().type
    results = dist_run(2, pipeline_grads, device)
    losses, parts = single_process_grads()
    ours = results[-1]["losses"]
    assert len(ours) == M and all(abs(a.item() - b.item()) <= FP32_TOL * abs(b.item()) for a, b in zip(ours, losses))
    schedule = build_schedule("1f1b", 2, M)
    ranges = split_layers(len(parts), schedule.num_chunks)
    for rank, r in enumerate(results):
        for c in chunks_on_rank(schedule, rank):
            ref = nn.Sequential(*(parts[i] for i in ranges[c]))
            for n, p in ref.named_parameters():
                assert rel_error(r["grads"][f"{c}.{n}"], p.grad) <= FP32_TOL, f"chunk {c} {n}"
