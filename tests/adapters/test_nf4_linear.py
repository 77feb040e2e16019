"""The lean NF4 linear (``lightning_plugins.adapters.nf4_linear``): torchao's results, bit for bit, in less memory.

Bitwise equal to torchao's ``linear_nf4`` (outputs and input gradients, bf16 and fp32 weights and inputs, one
chunk and several, the weight whole and in tiles, with a bias); a tile dequantizes to the whole weight's slice; a
QLoRA model (peft LoRA around the base, activation checkpointing) computes the same loss and adapter gradients
bit for bit as with torchao's path, tiled or not; the peak of live bytes during forward and backward stays near
the dense weight (torchao's path: ~7x), for real values and at real size under ``FakeTensorMode`` as the
planner's dry run runs it; a weight larger than a tile (405B's MLP) is never dense whole.
"""

from __future__ import annotations

import pytest
import torch
from _autograd import LargestTensor
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_model
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torchao.quantization import to_nf4
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

from lightning_plugins.adapters import nf4_linear as lean
from lightning_plugins.adapters.nf4_linear import NF4Linear, dequantize_nf4, dequantize_nf4_tile, nf4_linear
from lightning_plugins.adapters.qlora import nf4_nbytes, quantize_base_to_nf4

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

#: Small chunks, so that small weights take several (4 groups of 64 x 16 blocks).
SMALL_CHUNK = 4 * 64 * 16
#: Tiles of one quantization block (64 rows or columns): every weight here of 128 rows or columns or more is
#: tiled (a remainder under 64 rows joins the last tile).
SMALL_TILE = 1


def _torchao(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    out = linear_nf4(x, weight)
    return out if bias is None else out + bias


@pytest.mark.parametrize("tile", [lean.TILE_BYTES, SMALL_TILE], ids=["whole", "tiled"])
@pytest.mark.parametrize("chunk", [lean.CHUNK_ELEMENTS, SMALL_CHUNK], ids=["one-chunk", "several-chunks"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,group", [((256, 512), 16), ((96, 64), 2), ((48, 640), 4), ((160, 128), 4)])
def test_outputs_and_input_gradients_equal_torchaos_bitwise(
    monkeypatch: pytest.MonkeyPatch, tile: int, chunk: int, weight_dtype, input_dtype, shape, group: int
) -> None:
    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(lean, "TILE_BYTES", tile)
    gen = torch.Generator().manual_seed(0)
    weight = to_nf4(torch.randn(shape, generator=gen, dtype=weight_dtype), 64, group)
    chunks = -(-weight.numel() // max(chunk // (64 * group), 1) // (64 * group))
    assert chunk == lean.CHUNK_ELEMENTS or chunks > 1, "the small chunk must split every weight here"
    assert torch.equal(dequantize_nf4(weight, input_dtype), weight.to(input_dtype))
    bias = torch.randn(shape[0], generator=gen, dtype=input_dtype)
    for with_bias in (None, bias):
        x = torch.randn(3, 5, shape[1], generator=gen, dtype=input_dtype, requires_grad=True)
        grad = torch.randn(3, 5, shape[0], generator=gen, dtype=input_dtype)
        expected = _torchao(x, weight, with_bias)
        (expected_grad,) = torch.autograd.grad(expected, x, grad)
        out = nf4_linear(x, weight, with_bias)
        (out_grad,) = torch.autograd.grad(out, x, grad)
        assert out.dtype == input_dtype and torch.equal(out, expected)
        assert torch.equal(out_grad, expected_grad)


@pytest.mark.parametrize("name,tile", [("llama", lean.TILE_BYTES), ("llama_8bit_state", SMALL_TILE)], ids=["whole", "tiled"])
def test_a_qlora_model_runs_the_lean_linear_and_trains_as_with_torchaos(
    monkeypatch: pytest.MonkeyPatch, name: str, tile: int
) -> None:
    monkeypatch.setattr(lean, "TILE_BYTES", tile)
    tiles = []
    original_tile = lean.dequantize_nf4_tile
    monkeypatch.setattr(lean, "dequantize_nf4_tile", lambda *args: tiles.append(args[2:]) or original_tile(*args))
    torch.manual_seed(0)
    model = get_peft_model(tiny_model(name), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    converted = quantize_base_to_nf4(model)
    linears = [module for module in model.modules() if isinstance(module, NF4Linear)]
    assert converted == len(linears) > 0
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = {"input_ids": torch.randint(0, model.config.vocab_size, (2, 12))}
    batch["labels"] = batch["input_ids"].clone()

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    calls = []
    original = lean._LinearNF4.forward

    def counted(ctx, input, weight):
        calls.append(weight.shape)
        return original(ctx, input, weight)

    monkeypatch.setattr(lean._LinearNF4, "forward", staticmethod(counted))
    loss, grads = step()
    # Every NF4 linear ran through the lean function, again in the recomputed forward of checkpointing.
    assert len(calls) == 2 * len(linears), (len(calls), len(linears))
    # The 128-wide model's linears in tiles of 64 rows (forward) and columns (backward); the 32-wide one's whole.
    assert (len(tiles) > 4 * len(linears)) == (tile == SMALL_TILE), len(tiles)
    for module in linears:
        module.__class__ = nn.Linear  # torchao's path: F.linear on the NF4 weight
    expected_loss, expected_grads = step()
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert grad.abs().sum() > 0 and torch.equal(grad, expected_grads[name]), name


def _peak_bytes(linear, x: torch.Tensor, weight) -> int:
    """The most bytes live at once during forward and backward, from the tensors these create."""
    tracker = MemTracker()
    with tracker:
        out = linear(x, weight)
        out.backward(torch.ones_like(out))
    return tracker.get_tracker_snapshot("peak")[x.device]["Total"]


def test_the_peak_of_forward_and_backward_is_the_dense_weight_not_torchaos_transients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", 2**16)
    weight = to_nf4(torch.randn(2048, 1024, dtype=torch.bfloat16), 64, 256)
    x = torch.randn(4, 1024, dtype=torch.bfloat16, requires_grad=True)
    # The dense weight, the output, its gradient and the input's gradient.
    floor = weight.numel() * 2 + 2 * (4 * 2048 * 2) + x.numel() * 2
    lean_peak, torchao_peak = _peak_bytes(nf4_linear, x, weight), _peak_bytes(linear_nf4, x, weight)
    assert lean_peak <= 1.5 * floor, lean_peak / floor
    assert torchao_peak >= 5 * floor, torchao_peak / floor  # what the lean path avoids: the measure can tell


def _shapes_only_base(in_features: int, out_features: int) -> NF4Linear:
    """A LoRA base of real size and no values, as the planner's dry run quantizes it (on meta: ``to_empty`` it under
    ``FakeTensorMode``)."""
    with torch.device("meta"):
        module = nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    module.weight.requires_grad_(False)
    wrapper = get_peft_model(nn.Sequential(module), LoraConfig(r=8, target_modules=["0"]))
    assert quantize_base_to_nf4(wrapper, shapes_only=True) == 1
    base = wrapper.base_model.model[0].base_layer
    assert type(base) is NF4Linear
    return base


def test_at_real_size_under_fake_tensors_as_the_dry_run_measures() -> None:
    """A 70B MLP weight (8192 x 28672) of shapes only, as the planner's dry run builds and runs it."""
    base = _shapes_only_base(28672, 8192)
    with FakeTensorMode(allow_non_fake_inputs=True):
        base.to_empty(device="cpu")
        x = torch.empty(2, 1024, 28672, dtype=torch.bfloat16, requires_grad=True)
        floor = base.weight.numel() * 2 + 2 * (2 * 1024 * 8192 * 2) + x.numel() * 2
        lean_peak = _peak_bytes(nf4_linear, x, base.weight)
        torchao_peak = _peak_bytes(linear_nf4, x, base.weight)
    assert lean_peak <= 1.5 * floor, lean_peak / floor
    assert torchao_peak >= 5 * floor, torchao_peak / floor


def test_a_transposed_nf4_weight_is_refused_with_the_fix() -> None:
    weight = to_nf4(torch.randn(64, 128), 64, 2)
    with pytest.raises(ValueError, match="contiguous 2-D NF4 weight"):
        dequantize_nf4(weight.t(), torch.float32)


@pytest.mark.parametrize("shape", [(53248, 16384), (16384, 53248)], ids=["gate", "down"])
def test_a_405b_mlp_weight_is_never_dense_whole_under_fake_tensors(shape: tuple[int, int]) -> None:
    """Llama-3.1-405B's MLP weights (1.6 GiB dense in bf16), as the dry run multiplies them: in forward and backward
    the largest tensor created is a tile (or an activation), and the peak is the NF4 weight, the activations and
    their gradients plus about one tile (the whole dense weight before tiling: 1.6 GiB over them)."""
    out_features, in_features = shape
    base = _shapes_only_base(in_features, out_features)
    with FakeTensorMode(allow_non_fake_inputs=True):
        base.to_empty(device="cpu")
        weight = base.weight
        x = torch.empty(1, 2048, in_features, dtype=torch.bfloat16, requires_grad=True)
        largest = LargestTensor()
        with largest:
            out = nf4_linear(x, weight)
            out.backward(torch.ones_like(out))
        peak = _peak_bytes(nf4_linear, x, weight)
    dense = out_features * in_features * 2
    # The NF4 weight (the tracker counts it once an operation reads it), the input, the output, their gradients.
    held = nf4_nbytes(weight) + 2 * x.numel() * 2 + 2 * out.numel() * 2
    assert dense > 6 * lean.TILE_BYTES
    assert largest.largest <= 1.05 * lean.TILE_BYTES, largest.largest / lean.TILE_BYTES
    assert peak - held <= 1.5 * lean.TILE_BYTES, (peak - held) / lean.TILE_BYTES  # a tile and a chunk's transients


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_tile_is_the_whole_weights_slice_bitwise(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    monkeypatch.setattr(lean, "CHUNK_ELEMENTS", SMALL_CHUNK)
    weight = to_nf4(torch.randn(160, 640, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)), 64, 4)
    dense = weight.to(dtype)
    for rows, cols in [(slice(0, 160), slice(0, 640)), (slice(3, 101), slice(64, 448)), (slice(159, 160), slice(576, 640))]:
        assert torch.equal(dequantize_nf4_tile(weight, dtype, rows, cols), dense[rows, cols]), (rows, cols)
    with pytest.raises(ValueError, match="whole quantization blocks"):
        dequantize_nf4_tile(weight, dtype, slice(0, 160), slice(32, 640))
