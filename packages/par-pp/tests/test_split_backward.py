"""Zero-bubble's split backward: B + W give torch's full backward exactly, and W does not walk the
activation path again."""

import torch
from torch import nn

from par_pp.split_backward import backward_input, backward_weight


class Stage(nn.Module):
    """Linear with bias, LayerNorm, a bias-free Linear, and the first weight used a second time
    (a tied weight: two junctions feed one parameter)."""

    def __init__(self, h: int):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(h, 2 * h), nn.LayerNorm(2 * h), nn.Linear(2 * h, h, bias=False)

    def forward(self, x):
        y = self.down(torch.tanh(self.norm(self.up(x))))
        return y + (y @ self.up.weight[:, : y.shape[-1]].t()).sum(-1, keepdim=True)


def _run(stage, x0, dy, split: bool):
    params = list(stage.parameters())
    for p in params:
        p.grad = None
    x = x0.clone().requires_grad_(True)
    out = (stage(x) * dy).sum()
    tanh_runs = []
    tanh_node = next(n for n in _nodes(out.grad_fn) if type(n).__name__ == "TanhBackward0")
    tanh_node.register_prehook(lambda g: tanh_runs.append(1))
    if split:
        grad_in, pending = backward_input(out, x, params)
        assert all(p.grad is None for p in params), "B must not touch the weight grads"
        runs_in_b = len(tanh_runs)
        backward_weight(pending)
        assert len(tanh_runs) == runs_in_b == 1, "W walked the activation path again"
    else:
        torch.autograd.backward(out, inputs=params + [x])
        grad_in = x.grad
    return grad_in, [p.grad.clone() for p in params]


def _nodes(root):
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(c for c, _ in n.next_functions)
    return seen


def test_b_plus_w_equals_one_full_backward_and_w_skips_the_activation_path():
    torch.manual_seed(0)
    stage = Stage(16)
    x0, dy = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    ref_in, ref_params = _run(stage, x0, dy, split=False)
    got_in, got_params = _run(stage, x0, dy, split=True)
    # Same kernels on the same operands: equal up to summation order of the tied weight's two
    # contributions (fp32 rounding, measured 0 here).
    torch.testing.assert_close(got_in, ref_in, rtol=0, atol=0)
    for got, ref in zip(got_params, ref_params):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_w_is_one_engine_call_per_junction_without_tied_weights(monkeypatch):
    """Each junction's weight work is one backward straight to its parameters (no second pass
    from the weight edges), with the full backward's gradients."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 16, bias=False))
    x0, dy = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    ref_in, ref_params = _run(stage, x0, dy, split=False)
    params = list(stage.parameters())
    for p in params:
        p.grad = None
    x = x0.clone().requires_grad_(True)
    out = (stage(x) * dy).sum()
    grad_in, pending = backward_input(out, x, params)
    junctions = len(pending.junctions)
    calls = []
    for name in ("backward", "grad"):
        real = getattr(torch.autograd, name)
        monkeypatch.setattr(torch.autograd, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    backward_weight(pending)
    assert junctions == 3 and len(calls) == junctions  # the two Linears and the LayerNorm
    torch.testing.assert_close(grad_in, ref_in, rtol=0, atol=0)
    for p, ref in zip(params, ref_params):  # one contribution per parameter: bitwise the full backward's
        torch.testing.assert_close(p.grad, ref, rtol=0, atol=0)
