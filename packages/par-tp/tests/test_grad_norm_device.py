"""The TP grad-norm share is created where the parameters live, with or without grads (device follows
the data; the meta device stands in for CUDA here)."""

import torch
from torch import nn

from par_tp import tp_local_grad_norm_sq


def test_grad_norm_share_lives_on_the_params_device_even_before_any_backward():
    layer = nn.Linear(4, 4, device="meta")
    assert tp_local_grad_norm_sq(layer).device.type == "meta"  # no grads yet
    layer.weight.grad = torch.ones(4, 4, device="meta")
    assert tp_local_grad_norm_sq(layer).device.type == "meta"


def test_grad_norm_share_sums_the_squared_grads():
    layer = nn.Linear(2, 2)
    layer.weight.grad = torch.full((2, 2), 2.0)
    layer.bias.grad = torch.tensor([1.0, 3.0])
    assert tp_local_grad_norm_sq(layer).item() == 4 * 4.0 + 1.0 + 9.0
    assert tp_local_grad_norm_sq([]).item() == 0.0
