"""``export_hf`` on LoRA models in one process: the adapter directory and the merged weights load in plain
peft / transformers with the same logits; several adapters; peft's ``modules_to_save``; what cannot be merged.

(The same exports from parallelized models, TP, FSDP2, PP and TP x FSDP2, are checked in the worlds of
``test_lora_parity.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from tiny_models import make_batch, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_plugins.checkpoint.live_export import export_hf
from lightning_plugins.data import tiny_assets
from lightning_plugins.adapters.lora import LoraOptions, apply_lora

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TOL = 1e-5


def _randomize_adapters(model: nn.Module, seed: int = 2) -> None:
    """Non-zero ``lora_B`` (peft starts it at zero, where the adapter would change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def _logits(model: nn.Module) -> torch.Tensor:
    batch = make_batch(2, 12, model.config.vocab_size, seed=7)
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def test_adapter_and_merged_round_trip(tmp_path: Path) -> None:
    assets = tiny_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    options = LoraOptions(r=4, alpha=8, use_rslora=True)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(assets.model_dir), options)
    _randomize_adapters(model)
    want = _logits(model)
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(assets.model_dir))
    assert (want - base_logits).abs().max() > 1e-2, "the adapters must change the output"

    adapter = export_hf(model, tmp_path / "adapter", tokenizer)
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"}
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert keys == {n.replace(".default", "") for n, p in model.named_parameters() if p.requires_grad}, keys
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["use_rslora"] and config["inference_mode"]
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets.model_dir), adapter)
    torch.testing.assert_close(_logits(loaded), want, atol=TOL, rtol=0)

    merged_dir = export_hf(model, tmp_path / "merged", tokenizer, merge=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert set(merged.state_dict()) == set(AutoModelForCausalLM.from_pretrained(assets.model_dir).state_dict())
    assert json.loads((merged_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    torch.testing.assert_close(_logits(merged), want, atol=TOL, rtol=0)
    # The model being exported is left as it was (merging happens on copies of the weights).
    torch.testing.assert_close(_logits(model), want, atol=0, rtol=0)

    # Exporting again replaces the directory; nothing half-written is left behind.
    export_hf(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter.partial").exists() and not (tmp_path / "adapter" / "tokenizer.json").exists()


def test_several_adapters_and_modules_to_save(tmp_path: Path) -> None:
    base = tiny_model("llama")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    model = get_peft_model(base, config)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=2, target_modules=["down_proj"]))
    _randomize_adapters(model)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # the trained copy differs
    want = {}
    for name in ("default", "second"):
        model.set_adapter(name)
        want[name] = _logits(model)
    assert (want["default"] - want["second"]).abs().max() > 1e-2

    out = export_hf(model, tmp_path / "adapters")
    assert (out / "adapter_model.safetensors").is_file() and (out / "second" / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(tiny_model("llama"), out)
    loaded.load_adapter(out / "second", adapter_name="second")
    for name in ("default", "second"):
        loaded.set_adapter(name)
        torch.testing.assert_close(_logits(loaded), want[name], atol=TOL, rtol=0, msg=name)

    with pytest.raises(ValueError, match=r"lm_head \(ModulesToSaveWrapper\) is not.*merge_and_unload"):
        export_hf(model, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged").exists()


def test_what_cannot_be_merged_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no LoRA layer. Export it with merge=False"):
        export_hf(tiny_model("llama"), tmp_path / "full", merge=True)
    dora = get_peft_model(tiny_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj \(Linear\) is not"):
        export_hf(dora, tmp_path / "dora", merge=True)
    qlora = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_assets().model_dir), LoraOptions(r=4, quantize="nf4"))
    with pytest.raises(ValueError, match=r"NF4 \(QLoRA\); merging needs dense weights"):
        export_hf(qlora, tmp_path / "qlora", merge=True)
    export_hf(qlora, tmp_path / "qlora")  # the adapter of a QLoRA model exports (dense adapters only)
    with safe_open(str(tmp_path / "qlora" / "adapter_model.safetensors"), "pt") as handle:
        assert all("lora_" in key for key in handle.keys())
    assert not list(tmp_path.glob("*.partial"))
