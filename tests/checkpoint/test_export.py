"""``lightning-plugins export`` in one process: DCP checkpoints to HF / peft directories that plain transformers and
peft load with the same logits (tied embeddings, several shards, LoRA adapter and ``--merge`` against peft's own
``save_pretrained`` and ``merge_and_unload``), what it refuses, and a peak-memory bound on a model of a few
hundred MB: the export's peak resident memory grows by a few of its largest tensors, not by the model.

(Checkpoints written by the doors under TP, PP and LoRA are exported in ``test_finetune.py`` and
``test_accelerate_launch.py``, against the doors' own in-memory exports.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning_plugins.testing.world import run_command
from peft import PeftModel
from safetensors import safe_open
from tiny_models import CONFIGS, make_batch, tiny_model
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_plugins.checkpoint.export import ExportError, export_checkpoint, save_export_info
from lightning_plugins.adapters.lora import LoraOptions, apply_lora

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",
)
SCRIPT = Path(__file__).parents[1] / "scripts" / "export_memory.py"


def _save(model: nn.Module, directory: Path, source: Path | None = None) -> Path:
    """A checkpoint as the Accelerate door writes it (``model`` -> the state dict) plus its export info."""
    state = {"model": get_model_state_dict(model), "step": 3}
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    save_export_info(directory, model, "model", source)
    return directory


def _logits(model: nn.Module) -> torch.Tensor:
    batch = make_batch(2, 12, model.config.vocab_size, seed=7)
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def test_full_model_round_trip_tied_and_sharded(tmp_path: Path) -> None:
    model = tiny_model("llama_tied")
    source = tmp_path / "source"
    model.save_pretrained(source)
    ckpt = _save(model, tmp_path / "step=3.ckpt", source)
    out = export_checkpoint(ckpt, tmp_path / "hf", max_shard_size=20_000)  # several shards and an index
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file(), shards
    names = set()
    for shard in shards:
        with safe_open(str(out / shard), "pt") as handle:
            names |= set(handle.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: transformers re-ties
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)
    assert not list(tmp_path.glob("*.partial"))


def test_lora_adapter_and_merge_match_peft(tmp_path: Path) -> None:
    base = tiny_model("llama")
    source = tmp_path / "base"
    base.save_pretrained(source)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(source), LoraOptions(r=4, alpha=8, use_rslora=True))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # non-zero lora_B: the adapters change the output
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    ckpt = _save(model, tmp_path / "step=3.ckpt")  # the source is the config's name_or_path: `source`
    adapter = export_checkpoint(ckpt, tmp_path / "adapter")
    model.save_pretrained(tmp_path / "peft")  # peft's own adapter files
    with (
        safe_open(str(adapter / "adapter_model.safetensors"), "pt") as got,
        safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as want,
    ):
        assert set(got.keys()) == set(want.keys())
        for key in want.keys():
            torch.testing.assert_close(got.get_tensor(key), want.get_tensor(key), rtol=0, atol=0)
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), adapter)
    want_logits = _logits(model)
    torch.testing.assert_close(_logits(tuned), want_logits, rtol=0, atol=0)

    merged = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "merged", merge=True))
    reference = tuned.merge_and_unload()
    for name, weight in reference.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], weight, rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(_logits(merged), want_logits, rtol=1e-5, atol=1e-5)


def test_refuses_incomplete_checkpoints_foreign_models_and_existing_output(tmp_path: Path) -> None:
    model = tiny_model("llama")
    ckpt = _save(model, tmp_path / "step=3.ckpt")
    partial = tmp_path / "step=4.ckpt.partial"
    partial.mkdir()
    with pytest.raises(ExportError, match="no .metadata"):
        export_checkpoint(partial, tmp_path / "out")
    other = tmp_path / "other"
    LlamaConfig(**{**CONFIGS["llama"]().to_dict(), "hidden_size": 64}).save_pretrained(other)
    with pytest.raises(ExportError, match="another model"):
        export_checkpoint(ckpt, tmp_path / "out", model=other)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    with pytest.raises(ExportError, match="holds no LoRA"):
        export_checkpoint(ckpt, tmp_path / "out", merge=True)
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="--force"):
        export_checkpoint(ckpt, existing)
    assert (existing / "keep.txt").read_text() == "mine"
    export_checkpoint(ckpt, existing, force=True)
    assert not (existing / "keep.txt").exists() and (existing / "model.safetensors").is_file()


#: ~330 MB of fp32 weights in 219 tensors, the largest 8 MiB (embeddings and head).
_BIG = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 8,
        "num_key_value_heads": 8, "vocab_size": 4096}  # fmt: skip


def _export_peak(ckpt: Path, out: Path, model_dir: Path, mode: str) -> int:
    """Bytes the export child's peak resident memory grew by."""
    command = [sys.executable, str(SCRIPT), str(ckpt), str(out), str(model_dir), mode]
    proc = run_command(command, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return (result["peak_kib"] - result["before_kib"]) * 1024


def test_export_peak_memory_stays_near_the_largest_tensor(tmp_path: Path) -> None:
    config = LlamaConfig(**_BIG)
    model_dir = tmp_path / "model"
    config.save_pretrained(model_dir)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    model_bytes = sum(t.nbytes for t in state.values())
    largest = max(t.nbytes for t in state.values())
    assert model_bytes > 300e6 and model_bytes > 30 * largest and len(state) > 200
    ckpt = tmp_path / "step=1.ckpt"
    dcp.save({"state_dict": {"model": state}}, checkpoint_id=ckpt, no_dist=True)  # the Lightning door's nesting
    spot = {name: state[name].clone() for name in ("model.embed_tokens.weight", "model.layers.17.mlp.up_proj.weight")}
    del state

    grown = _export_peak(ckpt, tmp_path / "hf", model_dir, "streaming")
    print(f"export peak growth: streaming {grown / 2**20:.0f} MiB", end=" ")
    assert grown < 4 * largest + 32 * 2**20, f"streaming export grew by {grown / 2**20:.0f} MiB"
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(shapes)
    for name, want in spot.items():
        with safe_open(str(tmp_path / "hf" / weight_map[name]), "pt") as handle:
            torch.testing.assert_close(handle.get_tensor(name), want, rtol=0, atol=0)
    # The same measure sees an export that holds the whole model: the bound above means something.
    whole = _export_peak(ckpt, tmp_path / "hf_whole", model_dir, "whole")
    assert whole > 0.9 * model_bytes, f"holding every weight grew the peak by only {whole / 2**20:.0f} MiB"
