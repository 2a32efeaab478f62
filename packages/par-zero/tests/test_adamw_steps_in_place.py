"""par-zero's AdamW steps its buckets in place: the decay mask is one foreach call over contiguous runs,
bf16 grads go through one fp32 scratch chunk by chunk (no fp32 copy of a bucket per step), and the
fused kernel's step count is a tensor kept across steps. fp32 results are torch.optim.AdamW's
(foreach=False) bit for bit on the CPU; on fake CUDA the steps after the first allocate nothing."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from par_zero import optimizer as optimizer_module
from par_zero.config import DataParallelConfig
from par_zero.optimizer import DistributedAdamW, contiguous_runs

SHAPES = [(5, 3), (4,), (6, 2), (3,), (2, 5)]  # 1-D params are not decayed
DECAYED = [len(s) > 1 for s in SHAPES]


class FakeBucket(SimpleNamespace):
    """What the optimizer reads of a Bucket: master, opt_grad, opt_segments()."""

    __hash__ = object.__hash__


def _bucket(master: torch.Tensor, grad: torch.Tensor):
    offsets = [0]
    for s in SHAPES:
        offsets.append(offsets[-1] + torch.Size(s).numel())
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in SHAPES]
    segments = [(p, None, lo, hi, 0) for p, lo, hi in zip(params, offsets, offsets[1:])]
    return FakeBucket(master=master, opt_grad=grad, opt_segments=lambda: segments), params


def _cfg():
    return DataParallelConfig("no_shard", lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_bucket_adamw_equals_torch_adamw_bitwise(grad_dtype, monkeypatch):
    monkeypatch.setattr(optimizer_module, "GRAD_CHUNK", 7)  # several chunks, cutting params in two
    gen = torch.Generator().manual_seed(0)
    n = sum(torch.Size(s).numel() for s in SHAPES)
    master = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(4)]
    bucket, params = _bucket(master.clone(), grads[0].clone())
    ours = DistributedAdamW([bucket], _cfg(), decayed=lambda p: p.dim() > 1)
    ref = [torch.nn.Parameter(t.clone().view(s)) for t, s in zip(master.split([p.numel() for p in params]), SHAPES)]
    torch_opt = torch.optim.AdamW([{"params": [r for r, d in zip(ref, DECAYED) if d]},
                                   {"params": [r for r, d in zip(ref, DECAYED) if not d], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step, grad in enumerate(grads):
        lr = 1e-2 / (step + 1)
        bucket.opt_grad.copy_(grad)
        ours.set_lr(lr)
        ours.step()
        for r, g in zip(ref, grad.float().split([p.numel() for p in params])):
            r.grad = g.view(r.shape)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        assert torch.equal(bucket.master, torch.cat([r.detach().reshape(-1) for r in ref])), step


def test_contiguous_runs_merge_touching_ranges():
    assert contiguous_runs([(0, 4), (4, 6), (8, 9), (9, 12)]) == [(0, 6), (8, 12)]
    assert contiguous_runs([]) == []


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_steps_after_the_first_allocate_nothing_on_fake_cuda(monkeypatch):
    """bf16 grads on CUDA: the fused kernel per chunk, the decay once per bucket, and no op that makes a
    tensor (no .float() copy, no torch.full step count) once the scratch and step tensors exist."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(optimizer_module, "GRAD_CHUNK", 16)
    n = sum(torch.Size(s).numel() for s in SHAPES)
    with FakeTensorMode():
        buckets = [_bucket(torch.randn(n, device="cuda"), torch.randn(n, device="cuda").bfloat16())[0]
                   for _ in range(2)]
        opt = DistributedAdamW(buckets, _cfg(), decayed=lambda p: p.dim() > 1)
        opt.step()
        with Ops() as rec:
            opt.step()
    chunks = -(-n // 16)
    assert rec.ops.count("_fused_adamw_") == 2 * chunks and rec.ops.count("_foreach_mul_") == 2, rec.ops
    made = [op for op in rec.ops if op in ("empty", "full", "zeros", "_to_copy", "empty_like", "zeros_like", "clone")]
    assert made == [], made
    assert set(rec.ops) <= {"_fused_adamw_", "_foreach_mul_", "copy_", "fill_", "slice", "device"}, set(rec.ops)
