"""The fused AdamW call par-zero makes on CUDA is torch's fused kernel with our arguments: on the
CPU (which has the same kernel) it equals the explicit update to rounding."""

import torch

from par_zero.adamw import adamw_step_, clip_coefficient


def test_fused_adamw_equals_the_explicit_update():
    g = torch.Generator().manual_seed(0)
    p0, grads = torch.randn(1000, generator=g), [torch.randn(1000, generator=g) for _ in range(3)]
    states = {fused: [p0.clone(), torch.zeros(1000), torch.zeros(1000)] for fused in (False, True)}
    for step, grad in enumerate(grads, 1):
        for fused, (p, m, v) in states.items():
            adamw_step_(p, grad, m, v, step=step, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused)
    (p, m, v), (pf, mf, vf) = states[False], states[True]
    assert (p - p0).abs().max() > 1e-2  # it moved
    assert (p - pf).abs().max() < 1e-6 and (m - mf).abs().max() < 1e-7 and (v - vf).abs().max() < 1e-7


def test_clip_coefficient_is_a_tensor_capped_at_one():
    assert clip_coefficient(torch.tensor(4.0), 1.0).item() == 1.0 / (4.0 + 1e-6)
    assert clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_coefficient(torch.tensor(float("nan")), 1.0).item() == 1.0  # NaN norms leave grads to nan_policy


def test_cuda_params_take_the_fused_kernel_with_its_step_on_their_device():
    """On fake CUDA tensors: CUDA params choose the fused kernel by default, and the call (its step
    tensor made on the param's device, with no tensor of the host's: a host-to-GPU copy would
    wait for the stream) parses on this torch and updates in place."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from par_groups.testing.host_ops import CpuOutputs
    from par_zero.adamw import fused_adamw_available

    with FakeTensorMode():
        p = torch.randn(64, device="cuda")
        m, v, g = torch.zeros_like(p), torch.zeros_like(p), torch.randn_like(p)
        assert fused_adamw_available(p) and not fused_adamw_available(torch.randn(4, device="meta"))
        with CpuOutputs() as host:
            adamw_step_(p, g, m, v, step=1, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        assert all(t.device.type == "cuda" for t in (p, m, v))
        assert host.ops == [], host.ops
