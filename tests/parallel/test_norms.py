"""The memory-efficient RMSNorm: bit-identical to each model's own norm, forward and backward, saving less.

One process; the norms under sequence parallelism (DTensor ``Shard(1)``, q/k norms on ``Shard(2)``) are covered by
tests/parallel/test_parallel_parity.py, where every tensor-parallel case runs them (on by default).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from _autograd import LargestTensor, saved_bytes
from tiny_models import make_batch, tiny_model
from torch import nn

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.memory import norms
from lightning_plugins.parallel.memory.norms import _EfficientForward, norm_form, use_efficient_norms
from lightning_plugins.parallel.options import MemoryOptions

# (tiny family, the form its norms take, how many norms it has: 2 per layer + the final one, + q/k norms)
FAMILIES = [("llama", "llama", 5), ("qwen3", "llama", 9), ("olmo2", "olmo2", 17), ("gemma", "gemma", 5), ("gemma3", "gemma", 25)]


@pytest.mark.parametrize("family,form,count", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_bits_and_less_saved(family: str, form: str, count: int, dtype: torch.dtype) -> None:
    reference = tiny_model(family).to(dtype)
    with torch.no_grad():  # tiny models start with unit (or zero) norm weights: make the weight gradients matter
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_()
    model = copy.deepcopy(reference)
    assert use_efficient_norms(model) == count
    assert {norm_form(m)[0] for m in model.modules() if isinstance(m.forward, _EfficientForward)} == {form}
    assert use_efficient_norms(model) == 0  # already swapped
    batch = make_batch(2, 9, reference.config.vocab_size, seed=1)
    for one in (reference, model):
        one(**batch).loss.backward()
    torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, atol=0, rtol=0)
    # bf16: every gradient bit-identical. fp32: the input of a pre-norm is also the residual, and x.to(fp32) is then no
    # op, so autograd sums the residual's and the norm's two gradient contributions in one order and this function
    # (one contribution) in another: ~1e-7 of the largest gradient, the rounding of one fp32 addition per element.
    scale = 0 if dtype == torch.bfloat16 else 2e-6
    for (name, want), got in zip(reference.named_parameters(), model.parameters()):
        error = (got.grad - want.grad).abs().max().item()
        assert error <= scale * want.grad.abs().max().item(), f"{family} {name}: {error}"

    # One norm alone: the input (own dtype) and one fp32 value per row, nothing else.
    norm = next(m for m in model.modules() if isinstance(m.forward, _EfficientForward))
    plain = copy.deepcopy(norm)
    del plain.forward  # back to the class's own forward
    x = torch.randn(2, 9, norm.weight.shape[0], dtype=dtype, requires_grad=True)
    rows = x.numel() // x.shape[-1]
    assert saved_bytes(lambda: norm(x)) == x.numel() * x.element_size() + rows * 4
    # Alone (its input a leaf), the norm is bit-identical in fp32 too.
    grad = torch.randn_like(x)
    results = []
    for one in (plain, norm):
        x.grad = one.weight.grad = None
        out = one(x)
        out.backward(grad.to(out.dtype))
        results.append((out, x.grad, one.weight.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert saved_bytes(lambda: plain(x)) > x.numel() * 4  # at least one fp32 copy of the activation


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_in_blocks(family: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and the input's gradient a block of rows at a time: bit-identical, no fp32 temporary over a block."""
    norm = next(m for m in tiny_model(family).to(dtype).modules() if norm_form(m) is not None)
    with torch.no_grad():
        norm.weight.normal_()
    plain = copy.deepcopy(norm)
    assert use_efficient_norms(norm) == 1
    width = norm.weight.shape[0]
    monkeypatch.setattr(norms, "_BLOCK_ELEMENTS", 2 * width)  # 21 rows: 10 blocks of 2 and one of 1
    x = torch.randn(3, 7, width, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    for trainable in (True, False):
        results, largest = [], LargestTensor(torch.float32)
        for one in (plain, norm):
            x.grad = one.weight.grad = None
            one.weight.requires_grad_(trainable)
            with largest if one is norm else contextlib.nullcontext():
                out = one(x)
                out.backward(grad)
            results.append((out, x.grad, one.weight.grad))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
        # In bf16 any whole-size fp32 tensor is a temporary (in fp32 the result is one). The weight's gradient (one
        # sum over all rows, autograd's) is the only step over all rows at once.
        if dtype == torch.bfloat16 and not trainable:
            assert 0 < largest.largest <= 2 * width * 4


def test_other_norms_are_left_alone() -> None:
    class Scaled(nn.Module):  # an RMSNorm-like module of another form
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(4)), 1e-6

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return self.weight * hidden_states / hidden_states.norm(dim=-1, keepdim=True)

    model = nn.Sequential(nn.LayerNorm(4), Scaled(), nn.Linear(4, 4))
    assert use_efficient_norms(model) == 0
    assert all(norm_form(m) is None for m in model)


def test_option_is_validated() -> None:
    assert MemoryOptions().efficient_norms is True
    with pytest.raises(OptionsError, match="efficient_norms must be true or false"):
        MemoryOptions(efficient_norms="yes")  # type: ignore[arg-type]
