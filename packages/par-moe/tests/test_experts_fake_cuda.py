"""The experts' CUDA path, on fake CUDA tensors: torch's grouped GEMM takes our operands (bf16,
int32 group offsets on the tokens' device) and the output stays on CUDA in bf16. Its numbers are
checked on the CPU (tests/test_dispatch_and_balance.py) and on a GPU (test_gpu.py)."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from par_moe.experts import GroupLayout, grouped_linear, grouped_mm_supported


def test_grouped_gemm_call_takes_our_operands_on_fake_cuda():
    with FakeTensorMode():
        counts = torch.tensor([3, 0, 5, 8], device="cuda")
        layout = GroupLayout(counts, 16, max_count=8)
        x = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16)
        y = grouped_linear(x, w, layout, use_grouped_mm=True)
        assert y.shape == (16, 64) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
        assert layout.offsets.device.type == "cuda"
        # the grouped GEMM reads no count on the host (a GPU sync; on fake tensors .item() raises)
        unknown = GroupLayout(counts, 16)
        assert grouped_linear(x, w, unknown, use_grouped_mm=True).shape == (16, 64)
        assert "max_count" not in unknown.__dict__ and "group_of_row" not in unknown.__dict__
        # fp32 operands or rows that are not 16-byte aligned take the bmm path (no device query needed)
        assert not grouped_mm_supported(x.float(), w.float())
        assert not grouped_mm_supported(x, torch.randn(4, 60, 32, device="cuda", dtype=torch.bfloat16))
