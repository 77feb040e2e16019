"""A float8 linear with a frozen weight (LoRA's base) computes what torchao's does, saving no input for backward.

torchao's float8 matmul runs on CPU (``torch._scaled_mm``), so the two are compared here bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torchao.float8 import convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear

from lightning_plugins.parallel.float8 import FrozenFloat8Linear, freeze_float8_bases


def _forward_backward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Size]]:
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = model(x)
    (grad,) = torch.autograd.grad(y.square().sum(), x)
    return y, grad, saved


def test_a_frozen_float8_linear_matches_torchaos_and_keeps_only_its_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=True), nn.Linear(128, 32, bias=False)).to(torch.bfloat16)
    model.requires_grad_(False)
    convert_to_float8_training(model)
    frozen = copy.deepcopy(model)
    freeze_float8_bases(frozen)
    assert all(type(m) is FrozenFloat8Linear for m in frozen)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    (y, grad, saved), (y_frozen, grad_frozen, saved_frozen) = _forward_backward(model, x), _forward_backward(frozen, x)
    assert torch.equal(y_frozen, y) and torch.equal(grad_frozen, grad)
    # torchao keeps each linear's input and weight; the frozen ones keep their weights only.
    assert saved == [x.shape, (64, 128), (2, 8, 128), (128, 32)]
    assert saved_frozen == [(64, 128), (128, 32)]


def test_a_trainable_float8_linear_stays_torchaos() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    model[1].requires_grad_(False)
    convert_to_float8_training(model)
    freeze_float8_bases(model)
    assert type(model[0]) is Float8Linear and type(model[1]) is FrozenFloat8Linear
