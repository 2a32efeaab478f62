"""CUDA: a TP transformer block (bf16 autocast) equals the CPU fp32 single-device block.

tp=1 runs in this process; tp=2 (no SP: only all-reduces, which gloo does over CUDA tensors)
runs two ranks sharing the one GPU. SP needs all-gather / reduce-scatter of CUDA tensors, which
gloo does not provide, so it is left to NCCL on a multi-GPU machine.
"""

import pytest
import torch
import torch.distributed as dist

from par_groups.testing.gpu import assert_bf16_close, gpu_device
from par_tp.testing import TPTransformerBlock, tp_group_of_size

pytestmark = pytest.mark.gpu
S, B, H, HEADS, KV, FFN = 64, 2, 128, 8, 4, 256


def full_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    d = H // HEADS
    return {"norm1.weight": 1 + r(H), "norm1.bias": r(H), "norm2.weight": 1 + r(H), "norm2.bias": r(H),
            "wq": r(HEADS * d, H), "wk": r(KV * d, H), "wv": r(KV * d, H), "wo": r(H, HEADS * d),
            "w_gate": r(FFN, H), "w_up": r(FFN, H), "w_down": r(H, FFN)}


def run_block(group, device: str, bf16: bool):
    """Output, input grad and the full (gathered) wq grad of the block on ``device``."""
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    with torch.device(device):
        block = TPTransformerBlock(H, HEADS, KV, FFN, group)
    block.load_full_(full_weights())
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
        y = block(x)
    y.float().square().mean().backward()
    grad_wq = block.attn.wq.weight.grad
    if dist.get_world_size(group) > 1:
        parts = [torch.empty_like(grad_wq) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, grad_wq.contiguous(), group=group)
        grad_wq = torch.cat(parts)
    return y.detach().float().cpu(), x.grad.float().cpu(), grad_wq.float().cpu()


def _one_rank_group():
    return dist.new_group([dist.get_rank()])


def block_on(device: str, tp: int, bf16: bool):
    group = tp_group_of_size(tp) if tp > 1 else _one_rank_group()
    return run_block(group, device, bf16)


def cuda_tp_rank(device: str):
    if device == "cuda":
        torch.cuda.set_device(0)
    return block_on(device, 2, True)


@pytest.mark.parametrize("tp", [1, 2])
def test_tp_block_bf16_on_gpu_matches_cpu_fp32(dist_run, tp):
    device = gpu_device().type
    expected = dist_run(1, block_on, "cpu", 1, False)[0]
    actual = dist_run(1, block_on, device, 1, True)[0] if tp == 1 else dist_run(2, cuda_tp_rank, device)[0]
    for got, want, what in zip(actual, expected, ("output", "input grad", "wq grad")):
        assert_bf16_close(got, want, f"tp={tp} {what}")
