"""gpt-oss's MXFP4 expert weights on the hub load dequantized: the loader gives what transformers' own
``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))`` gives (weights and logits), each rank's
slice of the experts is the slice of that, and what cannot be given is refused before any storage is touched.

The checkpoint is the tiny gpt-oss with its experts replaced by random MXFP4 bytes (tests/_mxfp4.py). Layouts (EP x
TP, EP=4) load it in the world of tests/checkpoint/test_moe_checkpoint.py.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from _mxfp4 import write_mxfp4_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from lightning_plugins.checkpoint.load import checkpoint_index, load_sharded_safetensors
from lightning_plugins.checkpoint.mxfp4 import mxfp4_source
from lightning_plugins.errors import CheckpointError, RecipeError
from lightning_plugins.recipe.build import build_model
from lightning_plugins.recipe.schema import load_recipe

ROOT = Path(__file__).resolve().parents[2]
def _on_meta(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=dtype)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    packed = write_mxfp4_checkpoint(tmp_path)
    anchor = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    )
    model = _on_meta(tmp_path, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of ours
        load_sharded_safetensors(model, tmp_path)
    ours, theirs = model.state_dict(), anchor.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours), "weights differ from transformers'"
    gate_up = "model.layers.1.mlp.experts.gate_up_proj"
    assert ours[gate_up].abs().max() > 1 and ours[gate_up].shape == (4, 32, 128)  # dequantized, (experts, in, out)
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, anchor(ids).logits)
    # The loaded model is dense: what it saves loads in transformers as dense, with the same logits.
    assert not hasattr(model.config, "quantization_config") and not hasattr(anchor.config, "quantization_config")
    model.save_pretrained(tmp_path / "dense")
    with torch.no_grad():
        saved = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32)
        assert torch.equal(saved(ids).logits, anchor(ids).logits)

    # A rank's slice (EP: experts 1-2; a split of rows and columns) is the slice of the whole.
    source = mxfp4_source(gate_up, checkpoint_index(tmp_path), ours[gate_up])
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as handle:
        index = (slice(1, 3), slice(8, 24), slice(32, 96))
        piece = source.read(handle.get_slice, index, ours[gate_up].shape, torch.float32)
        assert torch.equal(piece, ours[gate_up][index])
        none_held = (slice(4, 4), slice(None), slice(None))
        empty = source.read(handle.get_slice, none_held, ours[gate_up].shape, torch.float32)
        assert empty.shape == (0, 32, 128)

    # The recipe's LoRA path (the base on the meta device under its adapters, then read) loads the experts dense too.
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "recipes" / "tiny" / "model" / file, tmp_path / file)
    overrides = [f"model.path={tmp_path}", "model.attn_implementation=eager"]
    lora = load_recipe(ROOT / "recipes" / "tiny" / "lora_fsdp2_chat.yaml", overrides)
    built, _ = build_model(lora)
    load_sharded_safetensors(built.get_base_model(), tmp_path)
    assert torch.equal(built.get_parameter(f"base_model.model.{gate_up}"), ours[gate_up])

    # bf16: what the dequantization gives in bf16, bit for bit.
    model = _on_meta(tmp_path, torch.bfloat16)
    load_sharded_safetensors(model, tmp_path)
    blocks, scales = packed[gate_up]
    assert torch.equal(model.state_dict()[gate_up], convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))


def test_what_mxfp4_cannot_give_is_refused_early(tmp_path: Path) -> None:
    write_mxfp4_checkpoint(tmp_path)
    model = _on_meta(tmp_path, torch.float32)
    fp8 = torch.empty(4, 64, 32, dtype=torch.float8_e4m3fn, device="meta")
    model.model.layers[0].mlp.experts.down_proj = torch.nn.Parameter(fp8, requires_grad=False)
    with pytest.raises(CheckpointError, match=r"MXFP4 .*not torch.float8_e4m3fn.*model.dtype"):
        load_sharded_safetensors(model, tmp_path)
    assert model.model.layers[1].mlp.experts.down_proj.is_meta  # refused before any storage

    names = dict.fromkeys(["model.layers.0.mlp.experts.down_proj_blocks"])
    with pytest.raises(CheckpointError, match="down_proj_scales.*needs both"):
        mxfp4_source("model.layers.0.mlp.experts.down_proj", names, torch.empty(4, 64, 32, device="meta"))

    # The recipe path: gpt-oss-120b's shipped config (mxfp4) validates quietly; QLoRA over MXFP4 is refused.
    recipe = ROOT / "recipes" / "gpt-oss-120b" / "lora_ep8.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_recipe(recipe).model.dtype == "bf16"
    with pytest.raises(RecipeError, match=r"MXFP4.*lora.quantize: none"):
        load_recipe(recipe, ["lora.quantize=nf4"])
