"""A zero-bubble pipeline's split backward through the FP8 GEMMs (par_pp.split_backward): B asks for the
input gradient alone, W for the weight gradient alone. Each FP8 linear (and the experts' grouped one)
computes only what is asked: B quantizes no weight-gradient operand, W no input-gradient one and never
reads the weight's values (ZeRO-3 has released them by then), and B + W give the full backward's
gradients bitwise."""

import pytest
import torch

from par_tp.fp8 import RECIPES, FP8GroupedKernel, fp8_linear, recording


def _linear(x, w, recipe):
    return fp8_linear(x, w, recipe)


def _grouped(x, w, recipe):  # 2 experts of [O, I], the rows of x in two segments of one source each
    return FP8GroupedKernel(recipe)(x, w, torch.tensor([[5], [3]]))


CASES = {"linear": (_linear, (8, 64), (32, 64)), "grouped": (_grouped, (8, 64), (2, 32, 64))}


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_split_backward_computes_each_gradient_once(kind, recipe):
    fn, xs, ws = CASES[kind]
    g = torch.Generator().manual_seed(4)
    x0, w0, up = torch.randn(*xs, generator=g), torch.randn(*ws, generator=g) * 0.1, torch.randn(8, 32, generator=g)
    # the full backward
    x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
    (fn(x * 1.0, w, recipe) * up).sum().backward()
    # B, then W with the weight's values released
    xb, wb = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
    loss = (fn(xb * 1.0, wb, recipe) * up).sum()
    with recording() as b_taps:
        (dx,) = torch.autograd.grad(loss, [xb], retain_graph=True)
    wb.data.untyped_storage().resize_(0)  # as ZeRO-3 frees a weight between B and W
    with recording() as w_taps:
        torch.autograd.backward([loss], inputs=[wb])
    assert b_taps and not any("weight-grad" in what for what, _ in b_taps), [w for w, _ in b_taps]
    assert w_taps and all("weight-grad" in what for what, _ in w_taps), [w for w, _ in w_taps]
    assert torch.equal(dx, x.grad) and torch.equal(wb.grad, w.grad)
