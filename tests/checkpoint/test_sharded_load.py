"""Every loading path reads each rank's slices of the checkpoint: a full fine-tune, LoRA, QLoRA, experts under EP (LoRA
on them, a router trained whole), MXFP4 experts, the text decoder of a multimodal checkpoint, tied embeddings and
pipeline stages. Built on the meta device and loaded after the layout is applied, every rank's parameters and
buffers equal, bit for bit, what one process builds from the loaded model (``from_pretrained``, the same seed's
adapters, the same layout). A hub id in the local cache takes the same path, and offline without it fails naming it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from _mxfp4 import write_mxfp4_checkpoint
from lightning_plugins.testing.world import run_world
from tiny_models import CONFIGS, tiny_model
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.parallel.quantized import is_nf4
from lightning_plugins.checkpoint import safetensors_io
from lightning_plugins.checkpoint.load import load_sharded_safetensors
from lightning_plugins.checkpoint.mxfp4 import dequantized
from lightning_plugins.checkpoint.snapshot import local_checkpoint
from lightning_plugins.checkpoint.text_tower import is_multimodal, text_config
from lightning_plugins.errors import CheckpointError, LayoutError
from lightning_plugins.parallel import parallelize
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.recipe.build import build_model
from lightning_plugins.recipe.schema import load_recipe

ROOT = Path(__file__).resolve().parents[2]
LORA = LoraOptions(r=4, alpha=8)
EXPERTS = LoraOptions(
    r=4, alpha=8, target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), modules_to_save=("gate",)
)
#: (checkpoint, LoRA options, layout, dtype): one world checks them all.
CASES = [
    ("llama", None, dict(dp_shard_size=2), torch.float32),
    ("llama_tied", LORA, dict(tp_size=2), torch.float32),  # column shards read in chunks of rows; tied head
    ("llama", LoraOptions(r=4, alpha=8, quantize="nf4"), dict(dp_shard_size=2), torch.bfloat16),
    ("mixtral", EXPERTS, dict(dp_shard_size=2, ep_size=2), torch.float32),  # experts in the hub's per-expert layout
    ("gpt_oss_mxfp4", LORA, dict(dp_shard_size=2, ep_size=2), torch.bfloat16),
    ("llama_4l", LORA, dict(pp_size=2), torch.float32),
    ("gemma3_multimodal", LORA, dict(dp_shard_size=2), torch.float32),
]


def _save_checkpoints(root: Path) -> None:
    for name in ("llama", "llama_tied", "mixtral", "llama_4l"):
        model = tiny_model(name)
        with torch.no_grad():  # norms away from 1, so that a norm read from the wrong tensor shows
            for key, param in model.named_parameters():
                if key.endswith("norm.weight"):
                    param.normal_(1, 0.5)
        model.save_pretrained(root / name)
    write_mxfp4_checkpoint(root / "gpt_oss_mxfp4")
    torch.manual_seed(0)
    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    Gemma3ForConditionalGeneration(config).save_pretrained(root / "gemma3_multimodal")


def _one_process_model(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    """What one process loads: ``from_pretrained`` (MXFP4 dequantized; a multimodal checkpoint's decoder read whole)."""
    config = AutoConfig.from_pretrained(directory)
    if is_multimodal(config):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text_config(config), dtype=dtype)
        load_sharded_safetensors(model, directory)
        return model
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **dequantized(config))


def _meta_model(directory: Path, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(text_config(AutoConfig.from_pretrained(directory)), dtype=dtype)


def _build(model: torch.nn.Module, lora: LoraOptions | None, layout: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(7)
    wrapped = model if lora is None else apply_lora(model, lora)
    parallelize(wrapped, ParallelLayout(**layout))
    return wrapped, model


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if is_nf4(local):  # codes, block scalers, their factors and the absmax mean
        parts = (local.quantized_data, local.quantized_scalers, local.quantization_factor, local.scaler_mean)
        return torch.cat([part.reshape(-1).view(torch.uint8) for part in parts])
    return local


def _check_paths(rank: int, world_size: int, root: str) -> None:
    safetensors_io.CHUNK_BYTES = 64  # a column shard is read a few rows at a time
    for name, lora, layout, dtype in CASES:
        directory = Path(root) / name
        expected, _ = _build(_one_process_model(directory, dtype), lora, layout)
        loaded, inner = _build(_meta_model(directory, dtype), lora, layout)
        load_sharded_safetensors(inner, directory)
        ours, theirs = dict(loaded.named_parameters()), dict(expected.named_parameters())
        assert ours.keys() == theirs.keys(), (name, sorted(set(ours) ^ set(theirs))[:4])
        for key, param in theirs.items():
            got, want = _comparable(ours[key]), _comparable(param)
            assert got.dtype == want.dtype and torch.equal(got, want), (name, layout, key)
        buffers = dict(loaded.named_buffers())
        for key, buffer in expected.named_buffers():
            assert torch.equal(_comparable(buffers[key]), _comparable(buffer)), (name, key)
        if lora is not None and lora.quantize == "nf4":
            assert sum(is_nf4(p) for p in ours.values()) > 0, "QLoRA's base is NF4"
        if "ep_size" in layout:  # each rank holds its own experts, not another rank's
            experts = next(p for key, p in ours.items() if key.endswith("down_proj") and p.dim() == 3)
            assert not any(key.endswith("gate_up_proj") and p.is_meta for key, p in ours.items())
            gathered = [torch.empty_like(_comparable(experts)) for _ in range(world_size)]
            torch.distributed.all_gather(gathered, _comparable(experts).contiguous())
            assert not torch.equal(gathered[0], gathered[1]), f"{name}: every rank read the same experts"


def test_every_path_reads_each_ranks_slices_bit_for_bit(tmp_path: Path) -> None:
    _save_checkpoints(tmp_path)
    run_world(_check_paths, 2, str(tmp_path))


def test_a_column_shard_is_read_in_bounded_chunks(tmp_path: Path) -> None:
    """A slice that keeps part of each row reads a chunk of rows at a time and equals safetensors' own slice."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensor = torch.arange(10 * 6 * 4, dtype=torch.float32).reshape(10, 6, 4)
    save_file({"w": tensor}, tmp_path / "w.safetensors")
    header, start = safetensors_io.read_header(tmp_path / "w.safetensors")
    lazy = safetensors_io.LazySlice(tmp_path / "w.safetensors", header["w"], start)
    with safe_open(tmp_path / "w.safetensors", framework="pt") as handle:
        theirs = handle.get_slice("w")
        cuts = [(slice(2, 7),), (slice(None), slice(1, 4)), (slice(3, 9), slice(0, 6), slice(2, 3)), (slice(5, 5),)]
        for index in cuts:
            for chunk in (1, 24, 10**9):
                safetensors_io.CHUNK_BYTES = chunk
                assert torch.equal(lazy[index], theirs[index]), (index, chunk)
    safetensors_io.CHUNK_BYTES = 64 * 2**20


def _cached_hub_id(cache: Path, repo_id: str, source: Path) -> Path:
    """``source``'s files as the Hugging Face cache holds a downloaded ``repo_id``."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hub_id_in_the_cache_loads_sharded_and_offline_without_it_fails_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "saved")
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "recipes" / "tiny" / "model" / file, tmp_path / "saved" / file)
    snapshot = _cached_hub_id(tmp_path / "hub", "someone/tiny-llama", tmp_path / "saved")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for recipe_file in ("full_tp2.yaml", "lora_fsdp2_chat.yaml"):
        recipe = load_recipe(ROOT / "recipes" / "tiny" / recipe_file, ["model.path=someone/tiny-llama"])
        built, _ = build_model(recipe)
        inner = built.get_base_model() if hasattr(built, "get_base_model") else built
        assert inner.model.embed_tokens.weight.is_meta, "nothing is loaded before the layout is applied"
        assert Path(inner.config.name_or_path) == snapshot
        load_sharded_safetensors(inner, snapshot)
        theirs = dict(model.named_parameters())
        for key, param in inner.named_parameters():
            if ".lora_" not in key:
                assert torch.equal(param, theirs[key.replace(".base_layer", "")]), key
    with pytest.raises(CheckpointError, match=r"someone/not-downloaded.*hf download someone/not-downloaded"):
        local_checkpoint("someone/not-downloaded")


# peft's warning, as users call it
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_adapters_left_on_the_meta_device_are_refused_naming_apply_lora(tmp_path: Path) -> None:
    """peft's own ``get_peft_model`` on a meta-device model leaves the adapters on meta: no checkpoint of the base can
    fill them, and the loader says how to build them instead."""
    from peft import LoraConfig, get_peft_model

    tiny_model("llama").save_pretrained(tmp_path)
    model = _meta_model(tmp_path, torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(LayoutError, match=r"q_proj\.lora_A.*apply_lora"):
        load_sharded_safetensors(model, tmp_path)
    assert model.model.embed_tokens.weight.is_meta, "nothing was given storage"


def test_lora_on_a_meta_base_keeps_real_parameters_and_builds_the_adapters_one_process_builds(tmp_path: Path) -> None:
    """apply_lora on a meta-device model: the adapters equal those of the loaded model under the same seed (peft draws
    them on the CPU), the base stays on meta, a parameter that was real stays the same tensor, ties stay tied."""
    tiny_model("llama_tied").save_pretrained(tmp_path)
    loaded = _one_process_model(tmp_path, torch.float32)
    torch.manual_seed(7)
    theirs = dict(apply_lora(loaded, LORA).named_parameters())
    model = _meta_model(tmp_path, torch.float32)
    norm = torch.nn.Parameter(torch.randn(model.model.norm.weight.shape))
    model.model.norm.weight = norm
    torch.manual_seed(7)
    ours = apply_lora(model, LORA)
    for key, param in ours.named_parameters():
        if ".lora_" in key:
            assert not param.is_meta and torch.equal(param, theirs[key]), key
        elif key.endswith("model.norm.weight"):
            assert param is norm
        else:
            assert param.is_meta, key
    base = ours.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight
