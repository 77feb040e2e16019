"""The memory-efficient gated MLP: bit-identical to each model's own MLP, forward and backward, saving one tensor less.

One process; under tensor parallelism (the gate/up column shards), FSDP2, pipeline and context parallelism the MLPs
run it in every parity test (on by default), e.g. tests/parallel/test_parallel_parity.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _autograd import saved_bytes
from tiny_models import make_batch, tiny_model
from torch import nn

from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.moe.experts import apply_expert_parallel
from lightning_plugins.parallel.memory.gated_mlp import _EfficientForward, mlp_form, use_efficient_mlps
from lightning_plugins.parallel.options import MemoryOptions

# (tiny family, its MLPs' forms, how many): llama/qwen3 SwiGLU, gemma GeGLU (tanh GELU), phi3's fused gate_up_proj,
# mixtral's fused experts (the engine's grouped forward calls their ``_apply_gate``), qwen2_moe's routed experts, shared
# expert (a Llama-form MLP) and one dense layer; gpt_oss's clamped gate is its own and keeps it.
FAMILIES = [
    ("llama", {"llama"}, 2),
    ("qwen3", {"llama"}, 2),
    ("gemma", {"llama"}, 2),
    ("phi3", {"phi3"}, 4),
    ("mixtral", {"experts"}, 2),
    ("qwen2_moe", {"llama", "experts"}, 3),
    ("gpt_oss", set(), 0),
]


_ACT = {"llama": "act_fn", "phi3": "activation_fn", "experts": "act_fn"}


@pytest.mark.parametrize("family,forms,count", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_bits_and_less_saved(family: str, forms: set[str], count: int, dtype: torch.dtype) -> None:
    reference = tiny_model(family).to(dtype)
    apply_expert_parallel(reference.model.layers, None)  # the engine's grouped experts forward, as parallelize gives
    model = copy.deepcopy(reference)
    assert use_efficient_mlps(model) == count
    assert {form for m in model.modules() if (form := mlp_form(m)) is not None} == {(f, _ACT[f]) for f in forms}
    assert use_efficient_mlps(model) == 0  # already swapped
    batch = make_batch(2, 9, reference.config.vocab_size, seed=1)
    saved = [saved_bytes(lambda: one(**batch)) for one in (reference, model)]
    assert saved[1] < saved[0] if count else saved[1] == saved[0]
    outs = [one(**batch) for one in (reference, model)]
    for out in outs:
        out.loss.backward()
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=0, rtol=0)
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=0, rtol=0, msg=lambda m: f"{family} {name}: {m}")

    # One MLP alone: gate and up (and the product down_proj keeps) are saved, not the activation's output too.
    mlp = next((m for m in model.modules() if isinstance(m.forward, _EfficientForward)), None)
    if mlp is None:  # only fused experts (their whole-model saving is checked above) or nothing swapped
        return
    plain = copy.deepcopy(mlp)
    del plain.forward  # back to the class's own forward
    x = torch.randn(2, 9, reference.config.hidden_size, dtype=dtype, requires_grad=True)
    width = mlp.down_proj.in_features
    activation = x.numel() // x.shape[-1] * width * x.element_size()
    assert saved_bytes(lambda: plain(x)) - saved_bytes(lambda: mlp(x)) == activation
    grad = torch.randn_like(x)
    results = []
    for one in (plain, mlp):
        x.grad = None
        for p in one.parameters():
            p.grad = None
        out = one(x)
        out.backward(grad)
        results.append((out, x.grad, *(p.grad for p in one.parameters())))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_lora_adapters_train_the_same() -> None:
    """peft's adapters on the projections: still called as modules, the same gradients to the bit."""
    reference = apply_lora(tiny_model("llama"), LoraOptions(r=4, alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # lora_B starts at zero: make every adapter's gradient matter
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.normal_()
    model = copy.deepcopy(reference)
    assert use_efficient_mlps(model) == 2
    batch = make_batch(2, 9, reference.config.vocab_size, seed=2)
    for one in (reference, model):
        one(**batch).loss.backward()
    grads = [[p.grad for p in one.parameters() if p.requires_grad] for one in (reference, model)]
    assert len(grads[0]) == 12
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_other_mlps_are_left_alone() -> None:
    class Gated(nn.Module):  # a gated MLP of another form
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
            self.act_fn = nn.SiLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    class Learned(nn.Module):  # an activation this does not know (with a parameter, whose gradient it would lose)
        def __init__(self) -> None:
            super().__init__()
            self.alpha = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.alpha * x

    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = Learned()
    model.add_module("other", Gated())
    assert use_efficient_mlps(model) == 0
    assert all(mlp_form(m) is None for m in model.modules())


def test_option_is_validated() -> None:
    assert MemoryOptions().efficient_mlp is True
    with pytest.raises(OptionsError, match="efficient_mlp must be true or false"):
        MemoryOptions(efficient_mlp="yes")  # type: ignore[arg-type]
