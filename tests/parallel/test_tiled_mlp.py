"""The tiled MLP: each dense MLP computed a few tokens at a time, the same values and gradients, its input saved only.

One process here; under FSDP2 with full activation checkpointing it trains as one process does in
tests/parallel/test_parallel_parity.py (``mlp_chunk_tokens``), and the planner's dry run counts it in
tests/planner/test_planner_dryrun.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _autograd import saved_bytes
from tiny_models import make_batch, tiny_model

from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.memory.activation import apply_activation_checkpointing
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.parallel.memory.gated_mlp import use_efficient_mlps
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel.memory.tiled_mlp import _tiles, _TiledForward, use_tiled_mlps

TOKENS = 4  # 2 x 9 tokens: five tiles, the last one short
# (tiny family, dense MLPs tiled): Llama's SwiGLU, Gemma's GeGLU, Phi-3's fused gate_up_proj, Qwen2-MoE's shared experts
# (its routed experts are left as they are).
FAMILIES = [("llama", 2), ("gemma", 2), ("phi3", 4), ("qwen2_moe", 2)]


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("family,count", FAMILIES)
def test_tiles_give_the_mlps_values_and_gradients(family: str, count: int) -> None:
    reference = tiny_model(family)
    model = copy.deepcopy(reference)
    use_efficient_mlps(model)
    assert use_tiled_mlps(model, TOKENS) == count
    assert use_tiled_mlps(model, TOKENS) == 0  # already tiled
    batch = make_batch(2, 9, reference.config.vocab_size, seed=1)
    outs = [one(**batch) for one in (reference, model)]
    for out in outs:
        out.loss.backward()
    # The rows are the untiled MLP's up to the matmuls' blocking; the weights' gradients are summed tile by tile.
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-6, rtol=1e-6)
    for (name, want), got in zip(reference.named_parameters(), _grads(model), strict=True):
        torch.testing.assert_close(got, want.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"{family} {name}: {m}")


def test_an_mlp_keeps_its_input_only() -> None:
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    plain = copy.deepcopy(mlp)
    use_tiled_mlps(mlp, TOKENS)
    x = torch.randn(2, 9, model.config.hidden_size, requires_grad=True)
    assert saved_bytes(lambda: mlp(x)) == x.numel() * x.element_size()
    assert saved_bytes(lambda: plain(x)) > 4 * 2 * 9 * mlp.down_proj.in_features * x.element_size()
    with torch.no_grad():  # no autograd: tiled all the same, nothing saved
        torch.testing.assert_close(mlp(x), plain(x), atol=1e-6, rtol=1e-6)


def test_checkpointed_lora_with_dropout_replays_each_tiles_mask() -> None:
    """LoRA with dropout on the MLP under full activation checkpointing: backward gets the masks forward drew.

    The reference runs the same tiles with autograd on (:func:`_tiles` without the function: every tile's
    intermediates kept), from the same generator state; the tiled function must give its gradients, each adapter's
    accumulated once per backward (as hooks on accumulation, FSDP2's and ``optimizer_in_backward``'s, expect), and
    leave the generator where forward left it.
    """
    lora = LoraOptions(r=4, alpha=8, dropout=0.3, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    reference = apply_lora(tiny_model("llama"), lora)
    with torch.no_grad():  # lora_B starts at zero: make every adapter's gradient matter
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.normal_()
    model = copy.deepcopy(reference)
    for one in (reference, model):
        apply_activation_checkpointing(one.base_model.model.model.layers, "full")
    use_tiled_mlps(model, TOKENS)
    for mlp in (layer.mlp for layer in reference.base_model.model.model.layers):
        mlp.forward = _NaiveTiles(mlp.forward)
    accumulated = []
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda p: accumulated.append(p))
    batch = make_batch(2, 9, reference.config.vocab_size, seed=3)
    states = []
    for one in (reference, model):
        one.train()
        torch.manual_seed(5)
        one(**batch).loss.backward()
        states.append(torch.get_rng_state())
    torch.testing.assert_close(states[1], states[0], atol=0, rtol=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(accumulated) == len(trainable) == 16 and {id(p) for p in accumulated} == {id(p) for p in trainable}
    for got, want in zip(_grads(model), _grads(reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class _NaiveTiles:
    """The tiles with autograd on (what the tiled function must equal, keeping every tile's intermediates)."""

    def __init__(self, forward) -> None:  # type: ignore[no-untyped-def]
        self.forward = forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([self.forward(rows[i : i + TOKENS]) for i in range(0, rows.shape[0], TOKENS)]).view(
            *x.shape[:-1], -1
        )


def test_tiles_of_no_autograd_and_short_inputs() -> None:
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    use_tiled_mlps(mlp, TOKENS)
    assert isinstance(mlp.forward, _TiledForward)
    x = torch.randn(1, 3, model.config.hidden_size)  # fewer tokens than a tile: the MLP as it is
    torch.testing.assert_close(mlp(x), mlp.forward.forward(x), atol=0, rtol=0)
    y = torch.randn(2, 5, model.config.hidden_size)
    torch.testing.assert_close(_tiles(mlp.forward.forward, y, 3), mlp.forward.forward(y), atol=1e-6, rtol=1e-6)


def test_option_is_validated_and_refused_where_it_cannot_run() -> None:
    assert MemoryOptions().mlp_chunk_tokens is None
    for bad in (-1, 1.5, True):
        with pytest.raises(OptionsError, match="mlp_chunk_tokens"):
            MemoryOptions(mlp_chunk_tokens=bad)  # type: ignore[arg-type]
    memory = MemoryOptions(mlp_chunk_tokens=1024)
    check_settings(ParallelLayout(dp_shard_size=2, cp_size=2, pp_size=2), ParallelOptions(), memory)
    with pytest.raises(OptionsError, match="tp_size=2"):
        check_settings(ParallelLayout(tp_size=2), ParallelOptions(), memory)
    with pytest.raises(OptionsError, match="compile=True"):
        check_settings(ParallelLayout(), ParallelOptions(compile=True), memory)
