"""QLoRA: NF4 base weights under peft LoRA adapters (``lightning_plugins.adapters.qlora``).

One process: what is converted, the bytes it takes (measured: codes + scalers + factors), the
dequantization error, and that forward/backward through the NF4 base equals a dense model holding the
dequantized weights while only adapters get gradients. One world of 2 gloo ranks: QLoRA trains under
FSDP2=2, PP=2 and CP=2 exactly as one process trains the same NF4 model (fp32, SGD with momentum, clipping
that triggers, prompt and padding tokens labelled ``-100``, rows of different lengths, random non-zero
``lora_B``), the loss falls, and the base stays 4-bit and untouched; FSDP2 gathers the base as NF4 (the bytes
counted at the all-gather). Errors: every layout NF4 cannot
take and every bad input to the converter.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
from lightning_plugins.testing.world import run_world
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_model
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.quantization import NF4Tensor, to_nf4
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_plugins import LayoutError, ParallelLayout, ParallelOptions, parallelize
from lightning_plugins.data import collate_causal_lm, load_prompt_completion, tiny_assets
from lightning_plugins.parallel import clip_grad_norm_, context_parallel_batch, mesh_of, pipeline_of
from lightning_plugins.adapters.qlora import (
    default_scaler_block_size,
    nf4_nbytes,
    nf4_nbytes_for,
    quantize_base_to_nf4,
)
from lightning_plugins.parallel.quantized import check_quantized, is_nf4, nf4_weights

# peft's get_peft_model reads a transformers attribute deprecated in 5.x: third-party noise.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

ASSETS = tiny_assets()
#: Adapted linears; k/o/gate/up stay unadapted, so both kinds of frozen linear are converted.
TARGETS = ("q_proj", "v_proj", "down_proj")
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STEPS, SAMPLES, MAX_NORM, LR = 5, 8, 0.1, 1.0
TOL = 1e-5
#: Largest gap between neighbouring NF4 levels (-1.0 to -0.6962): rounding to the nearest level errs by at
#: most half of it, in units of the block's absmax.
HALF_NF4_GAP = (1.0 - 0.6962) / 2


def qlora_model(seed: int = 0, quantize: bool = True, **quantize_kwargs: int) -> nn.Module:
    """The tiny checkpoint with LoRA (r=4) on ``TARGETS``, random non-zero ``lora_B``, NF4 base when asked."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(ASSETS.model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS)))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts lora_B at zero, where lora_A would get no gradient
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    if quantize:
        quantize_base_to_nf4(model, **quantize_kwargs)
    return model


def tiny_batch() -> dict[str, torch.Tensor]:
    """A handful of string-reversal samples: prompt and padding labelled -100, rows of different lengths."""
    tokenizer = AutoTokenizer.from_pretrained(ASSETS.model_dir)
    examples = load_prompt_completion(ASSETS.train_file, tokenizer, max_length=32)[:SAMPLES]
    return collate_causal_lm(examples, pad_token_id=tokenizer.pad_token_id)


def dequantized_twin(model: nn.Module) -> nn.Module:
    """The same LoRA model, dense, with each NF4 base weight replaced by its dequantized values."""
    twin = qlora_model(quantize=False)
    weights = dict(nf4_weights(model))
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if name in weights:
                param.copy_(weights[name].get_original_weight())
    return twin


# --------------------------------------------------------------------------------------------- one process


def test_every_frozen_decoder_linear_becomes_nf4_and_the_rest_stays_dense() -> None:
    model = qlora_model(quantize=False)
    layers = model.config.num_hidden_layers
    assert quantize_base_to_nf4(model) == layers * len(DECODER_LINEARS)
    for name, param in model.named_parameters():
        decoder_linear = any(f"{proj}." in name for proj in DECODER_LINEARS) and "lora_" not in name
        assert is_nf4(param) == decoder_linear, name
        assert param.requires_grad == ("lora_" in name), name
    assert {name for name, _ in nf4_weights(model)} == {
        name for name, _ in model.named_parameters() if "layers." in name and "lora_" not in name and "norm" not in name
    }
    assert quantize_base_to_nf4(model) == 0, "a second call must leave the NF4 weights alone"


def test_adapters_keep_the_bf16_dtype_next_to_the_nf4_base_with_autocast_adapter_dtype_off() -> None:
    from lightning_plugins.adapters.lora import LoraOptions, apply_lora

    model = AutoModelForCausalLM.from_pretrained(ASSETS.model_dir, dtype=torch.bfloat16)
    model = apply_lora(model, LoraOptions(r=4, alpha=8, target_modules=TARGETS, quantize="nf4", autocast_adapter_dtype=False))
    adapters = {name: param for name, param in model.named_parameters() if param.requires_grad}
    assert adapters and all("lora_" in name and param.dtype == torch.bfloat16 for name, param in adapters.items())
    bases = [weight for _, weight in nf4_weights(model)]
    assert bases and all(weight.dtype == torch.bfloat16 for weight in bases)
    batch = tiny_batch()
    loss = model(**batch).loss
    loss.backward()
    assert all(param.grad is not None and param.grad.dtype == torch.bfloat16 for param in adapters.values())


@pytest.mark.parametrize(
    "family,config",
    [
        ("llama_tied", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["k_proj"])),
        ("llama", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], modules_to_save=["k_proj"])),
    ],
    ids=["tied-head", "adapted-head"],
)
def test_head_embeddings_and_modules_to_save_stay_dense(family: str, config: LoraConfig) -> None:
    model = get_peft_model(tiny_model(family), config)
    assert quantize_base_to_nf4(model) == 2 * (len(DECODER_LINEARS) - 1)  # every decoder linear but k_proj
    quantized = {name for name, _ in nf4_weights(model)}
    assert not any("lm_head" in name or "embed" in name or "k_proj" in name for name in quantized), quantized
    assert sum("q_proj.base_layer" in name for name in quantized) == 2, quantized


def test_nf4_bytes_are_a_quarter_of_bf16() -> None:
    model = qlora_model()
    for name, weight in nf4_weights(model):
        measured = nf4_nbytes(weight)
        # Codes (4 bits) + int8 absmax per block + one fp32 factor per scaler group + mean + 16-entry table.
        assert measured == nf4_nbytes_for(
            weight.numel(), dtype=weight.dtype, block_size=weight.block_size, scaler_block_size=weight.scaler_block_size
        ), name
        assert weight.quantized_data.numel() == weight.numel() // 2 and weight.quantized_data.dtype == torch.uint8
        assert weight.quantized_scalers.numel() == weight.numel() // 64 and weight.quantized_scalers.dtype == torch.int8
        assert measured / (2 * weight.numel()) < 0.28, name
    # A real-size weight in bf16 keeps scaler groups of 256: 0.258x the bf16 bytes (QLoRA's 4.127 bits).
    weight = torch.randn(1024, 4096, dtype=torch.bfloat16)
    nf4 = to_nf4(weight, 64, default_scaler_block_size(weight.shape))
    assert nf4.scaler_block_size == 256
    assert nf4_nbytes(nf4) / (2 * weight.numel()) == pytest.approx((0.5 + 1 / 64 + 2 / (64 * 256)) / 2, abs=1e-5)


# Llama-3 8B and 70B projections (q/o, k/v, gate/up, down).
@pytest.mark.parametrize(
    "shape", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (1024, 8192)]
)
def test_real_size_weights_keep_groups_of_256_and_shard_over_64_ranks(shape: tuple[int, int]) -> None:
    assert default_scaler_block_size(shape) == 256
    nf4 = to_nf4(torch.empty(shape, dtype=torch.bfloat16, device="meta"), 64, 256)
    assert nf4_nbytes(nf4) == nf4_nbytes_for(shape[0] * shape[1])
    groups = shape[0] * shape[1] // (64 * 256)
    assert shape[0] % 64 == 0 and groups % 64 == 0


def test_dequantization_error_is_nf4s() -> None:
    model = qlora_model(quantize=False)
    dense = {name: p.detach().clone() for name, p in model.named_parameters()}
    quantize_base_to_nf4(model)
    for name, weight in nf4_weights(model):
        original, restored = dense[name], weight.get_original_weight()
        blocks = original.reshape(-1, weight.block_size)
        error = (restored.reshape(-1, weight.block_size) - blocks).abs()
        absmax = blocks.abs().amax(dim=1, keepdim=True)
        # Nearest-level rounding, plus the int8 quantization of each block's absmax (well under 1%).
        assert (error <= (HALF_NF4_GAP + 0.005) * absmax).all(), (name, (error / absmax).max())
        relative = ((restored - original).norm() / original.norm()).item()
        assert 0.08 < relative < 0.1, (name, relative)  # 4 bits: ~0.09 (bitsandbytes NF4 measures 0.091 here)
    gaussian = torch.randn(512, 512)
    relative = ((to_nf4(gaussian, 64, 256).get_original_weight() - gaussian).norm() / gaussian.norm()).item()
    assert 0.08 < relative < 0.1, relative


def test_forward_and_backward_equal_the_dequantized_dense_model_and_only_adapters_get_grads() -> None:
    model, batch = qlora_model(), tiny_batch()
    twin = dequantized_twin(model)
    loss, twin_loss = model(**batch).loss, twin(**batch).loss
    loss.backward()
    twin_loss.backward()
    torch.testing.assert_close(loss, twin_loss, atol=TOL, rtol=0)
    twin_params = dict(twin.named_parameters())
    adapters = 0
    for name, param in model.named_parameters():
        if "lora_" in name:
            adapters += 1
            assert param.grad is not None and param.grad.abs().sum() > 0, name
            torch.testing.assert_close(param.grad, twin_params[name].grad, atol=TOL, rtol=0, msg=name)
        else:
            assert param.grad is None, name
    assert adapters == 2 * len(TARGETS) * model.config.num_hidden_layers


# --------------------------------------------------------------------------------- one world of 2 ranks

# name -> (layout sizes, parallel options)
CASES = {
    "fsdp2": ({"dp_shard_size": 2}, {}),
    "pp2": ({"pp_size": 2}, {"pp_microbatches": 2}),
    "cp2 ring": ({"cp_size": 2}, {"cp_backend": "ring"}),
}


def _train(model: nn.Module, prepare, clip) -> tuple[list[float], list[float]]:
    """STEPS SGD-with-momentum steps on the same batch; per-step losses and pre-clip gradient norms.

    Under PP ``model(**batch)`` already ran backward (the schedule does); elsewhere ``backward`` runs here.
    """
    batch = prepare(tiny_batch())
    adapters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(adapters, lr=LR, momentum=0.9)
    model.train()
    losses, norms = [], []
    for _ in range(STEPS):
        loss = model(**batch).loss
        if loss.requires_grad:
            loss.backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "the base got a gradient"
        norm = clip(adapters, MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(float(norm))
    return losses, norms


@functools.cache
def _reference() -> tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole batch: losses, norms, final adapters, and the (untouched) NF4 codes."""
    model = qlora_model()
    losses, norms = _train(model, lambda batch: batch, torch.nn.utils.clip_grad_norm_)
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    codes = {name: w.quantized_data.clone() for name, w in nf4_weights(model)}
    return losses, norms, adapters, codes


def _run_case(world_size: int, sizes: dict, options: dict) -> dict[str, float]:
    ref_losses, ref_norms, ref_adapters, ref_codes = _reference()
    peft_model = qlora_model()
    # The transformers model inside the PeftModel (its LoRA layers included) is what gets parallelized.
    layout = ParallelLayout(**sizes).resolve(world_size)
    check_quantized(peft_model, layout)
    model = parallelize(peft_model.get_base_model(), layout, ParallelOptions(**options))
    mesh = mesh_of(model)
    pipeline = pipeline_of(model)
    dp = mesh["dp"]
    rows = slice(dp.get_local_rank() * SAMPLES // dp.size(), (dp.get_local_rank() + 1) * SAMPLES // dp.size())

    def prepare(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return context_parallel_batch({k: v[rows] for k, v in batch.items()}, mesh)

    clip = pipeline.clip_grad_norm_ if pipeline is not None else clip_grad_norm_
    losses, norms = _train(model, prepare, clip)

    adapter_diff, held = 0.0, 0
    for name, param in peft_model.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            adapter_diff = max(adapter_diff, (full.detach() - ref_adapters[name]).abs().max().item())
            held += 1
    # The base is still 4-bit on every rank, split in equal row shards under FSDP2, and never moved.
    shards = mesh["dp_shard_cp"].size()
    code_diff, base_ok = 0, True
    for name, param in peft_model.named_parameters():
        if param.requires_grad or param.ndim != 2 or "layers." not in name:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        rows = ref_codes[name].numel() * 2 // param.shape[1]
        base_ok &= isinstance(local, NF4Tensor) and local.shape[0] * shards == rows
        start = mesh["dp_shard_cp"].get_local_rank() * local.quantized_data.numel()
        expected = ref_codes[name][start : start + local.quantized_data.numel()]
        code_diff = max(code_diff, int((local.quantized_data != expected).sum()))
    initial = dict(qlora_model().named_parameters())
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)),
        "adapter_diff": adapter_diff,
        "adapter_change": max((ref_adapters[n] - initial[n]).abs().max().item() for n in ref_adapters),
        "loss_fall": ref_losses[0] - ref_losses[-1],
        "adapters_held": held,
        "base_nf4": float(base_ok),
        "code_diff": code_diff,
    }


def _gathered_bytes(quantize: bool, world_size: int) -> dict[str, int]:
    """Bytes this rank hands FSDP2's all-gathers in one forward under FSDP2=``world_size`` (every unit gathers
    once), counted at ``dist.all_gather_single``, and what the local shards predict: for an NF4 shard the 4-bit
    codes, int8 scalers and factors its ``fsdp_pre_all_gather`` hands over, for a dense one its bytes."""
    import torch.distributed as dist

    peft_model = qlora_model(quantize=quantize)
    model = parallelize(peft_model.get_base_model(), ParallelLayout(dp_shard_size=world_size).resolve(world_size))
    predicted = base = 0
    for name, param in model.named_parameters():
        local = param.to_local()
        if is_nf4(local):
            inputs, _ = local.fsdp_pre_all_gather(mesh_of(model)["dp_shard_cp"])
            nbytes = sum(t.numel() * t.element_size() for t in inputs)
        else:
            nbytes = local.numel() * local.element_size()
        predicted += nbytes
        base += nbytes if "layers." in name and "lora_" not in name and "norm" not in name else 0
    sent: list[int] = []
    all_gather = dist.all_gather_single

    def counting(output: torch.Tensor, input: torch.Tensor, *args, **kwargs):
        sent.append(input.numel() * input.element_size())
        return all_gather(output, input, *args, **kwargs)

    dist.all_gather_single = counting
    try:
        with torch.no_grad():
            model(**tiny_batch())
    finally:
        dist.all_gather_single = all_gather
    return {"sent": sum(sent), "gathers": len(sent), "predicted": predicted, "base": base}


def _world(rank: int, world_size: int, out_dir: str) -> None:
    results = {name: _run_case(world_size, *case) for name, case in CASES.items()}
    results["gathered"] = {kind: _gathered_bytes(kind == "nf4", world_size) for kind in ("nf4", "dense")}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results() -> list[dict[str, dict[str, float]]]:
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_world, 2, out_dir)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_qlora_trains_like_one_process(name: str) -> None:
    per_rank = [results[name] for results in _results()]
    for rank, diffs in enumerate(per_rank):
        where = (name, rank, diffs)
        assert diffs["adapter_change"] > 100 * TOL, where  # parity is only meaningful if the adapters moved
        assert diffs["loss_fall"] > 0.1, where
        assert diffs["loss_diff"] <= TOL, where
        assert diffs["norm_diff"] <= TOL, where
        assert diffs["adapter_diff"] <= TOL, where
        assert diffs["base_nf4"] == 1.0 and diffs["code_diff"] == 0, where
    # Pipeline stages hold disjoint adapters; everywhere else each rank holds all of them.
    total = 2 * len(TARGETS) * 2
    held = [diffs["adapters_held"] for diffs in per_rank]
    assert sum(held) == total if name.startswith("pp") else held == [total, total], held


def test_fsdp2_gathers_the_base_as_nf4() -> None:
    """The frozen base crosses FSDP2's all-gather as NF4 (codes, scalers, factors): the bytes sent, counted at the
    collective, are what the NF4 shards hand over, ~0.13x the same base gathered dense in fp32."""
    layers = qlora_model(quantize=False).config.num_hidden_layers
    for results in _results():
        nf4, dense = results["gathered"]["nf4"], results["gathered"]["dense"]
        for counted in (nf4, dense):
            # Each decoder layer, the embedding and the final norm + head, once (the root holds no parameter).
            assert counted["gathers"] == layers + 2, counted
            assert counted["sent"] == counted["predicted"], counted
        # The rest (embedding, head, norms, adapters) is the same dense bytes in both models.
        assert nf4["sent"] - nf4["base"] == dense["sent"] - dense["base"], (nf4, dense)
        # 4-bit codes + an int8 absmax per 64 weights + the factors of tiny scaler groups, over 32-bit weights.
        assert 0.125 < nf4["base"] / dense["base"] < 0.14, (nf4, dense)


# ------------------------------------------------------------------------------------------------- errors


def test_tensor_parallelism_is_refused_naming_a_layout_that_works() -> None:
    model = qlora_model()
    with pytest.raises(LayoutError, match="do not compose with tensor parallelism") as err:
        check_quantized(model, ParallelLayout(tp_size=2).resolve(2))
    assert "ParallelLayout(dp_shard_size=2)" in str(err.value) and "q_proj.base_layer.weight" in str(err.value)
    check_quantized(model, ParallelLayout(dp_shard_size=2).resolve(2))  # the suggestion passes
    with pytest.raises(LayoutError, match=r"ParallelLayout\(pp_size=2, dp_shard_size=2\)"):
        check_quantized(model, ParallelLayout(pp_size=2, tp_size=2).resolve(4))
    check_quantized(qlora_model(quantize=False), ParallelLayout(tp_size=2).resolve(2))  # plain LoRA is not our call


def test_parallelize_refuses_tensor_parallel_qlora_before_any_collective() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch.distributed as dist

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        model = qlora_model()
        with pytest.raises(LayoutError, match="do not compose with tensor parallelism"):
            parallelize(model, ParallelLayout(tp_size=2))
        assert mesh_of(model.get_base_model()) is None  # nothing was applied
    finally:
        dist.destroy_process_group()


def test_a_weight_fsdp2_cannot_split_is_named_with_its_fix() -> None:
    # k_proj is 64 x 128: 128 blocks in 2 groups of 64, which 4 shards cannot split.
    model = qlora_model(scaler_block_size=64)
    with pytest.raises(LayoutError) as err:
        check_quantized(model, ParallelLayout(dp_shard_size=4).resolve(4))
    message = str(err.value)
    assert "k_proj.weight of shape (64, 128)" in message and "over 4 FSDP2 ranks" in message, message
    assert "scaler_block_size=32" in message, message
    check_quantized(qlora_model(scaler_block_size=32), ParallelLayout(dp_shard_size=4).resolve(4))
    # 3 ranks cannot split 128 rows at all: only another shard count helps (cp counts: FSDP2 shards over it).
    with pytest.raises(LayoutError, match=r"q_proj.base_layer.weight of shape \(128, 128\).*shard count that divides"):
        check_quantized(qlora_model(), ParallelLayout(dp_shard_size=3).resolve(3))
    with pytest.raises(LayoutError, match="over 4 FSDP2 ranks"):
        check_quantized(model, ParallelLayout(dp_shard_size=2, cp_size=2).resolve(4))
    check_quantized(model, ParallelLayout(dp_replicate_size=4).resolve(4))  # replicas do not split weights
    with pytest.raises(LayoutError, match="resolved layout"):
        check_quantized(model, ParallelLayout())


def test_bad_input_to_the_converter() -> None:
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(ASSETS.model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="has no LoRA layer.*get_peft_model"):
        quantize_base_to_nf4(plain)
    with pytest.raises(ValueError, match="block_size=48"):
        quantize_base_to_nf4(qlora_model(quantize=False), block_size=48)
    with pytest.raises(ValueError, match=r"scaler_block_size=256.*scaler_block_size=None"):
        quantize_base_to_nf4(qlora_model(quantize=False), scaler_block_size=256)
    with pytest.raises(ValueError, match="positive even integer"):
        quantize_base_to_nf4(qlora_model(quantize=False), block_size=63)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(plain.config)
    with pytest.raises(ValueError, match="meta device.*load the real weights first"):
        quantize_base_to_nf4(get_peft_model(meta, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS))))


def test_mixture_of_experts_keeps_its_experts_dense_and_refuses_nf4_under_expert_adapters() -> None:
    """QLoRA on a MoE model quantizes attention; 3-D expert weights are no ``nn.Linear``, so adapters on them refuse."""
    model = get_peft_model(tiny_model("mixtral"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    assert quantize_base_to_nf4(model) == 2 * 4  # q/k/v/o of both layers
    quantized = {name for name, _ in nf4_weights(model)}
    assert all("self_attn." in name for name in quantized), quantized
    assert not any(is_nf4(p) for n, p in model.named_parameters() if ".mlp." in n)  # experts and router stay dense
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    experts = get_peft_model(tiny_model("mixtral"), config)
    with pytest.raises(ValueError, match=r"mlp\.experts is LoRA on the expert weight down_proj.*leave target_parameters"):
        quantize_base_to_nf4(experts)
