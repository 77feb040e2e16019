"""Tiny twins of the shipped image-text recipes (``lightning-plugins tiny``, ``recipe/tiny_image_text.py``): each
is the family's whole model shrunk with the family's shipped tiny processor and images, and its rows run through that
model. The Qwen-VL processors are built only with torchvision: their tests are marked ``torchvision`` (deselected by
default; ``python -m pytest -m torchvision`` where torch 2.14.1 and torchvision 0.29.1 are installed, as .ci/run's
.venv-vision), and where ``import torchvision`` fails those twins are refused, naming it (tested here in every
environment). The twins train through both doors in ``tests/recipe/test_recipes.py`` (slow; Qwen-VL's: torchvision).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from _launch import ROOT

from lightning_plugins.recipe.schema import load_recipe

IMAGE_TEXT = {"gemma-3-27b/full_8gpu": "gemma3", "qwen2.5-vl-7b/lora_1gpu": "qwen2_5_vl",
              "qwen2.5-vl-7b/lora_32k_cp": "qwen2_5_vl", "qwen3-vl-30b-a3b/lora_ep8": "qwen3_vl_moe"}  # fmt: skip
QWEN_VL = [name for name, family in IMAGE_TEXT.items() if family.startswith("qwen")]


def test_every_image_text_recipe_is_named_here() -> None:
    recipes = [p for p in (ROOT / "recipes").glob("*/*.yaml") if p.parent.name not in ("tiny", "slurm")]
    formats = {f"{p.parent.name}/{p.stem}": (yaml.safe_load(p.read_text())["data"].get("format")) for p in recipes}
    assert {name for name, kind in formats.items() if kind == "image_text"} == set(IMAGE_TEXT)


def test_gemma_twin_is_the_family_shrunk_and_its_rows_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from lightning_plugins.cli import main
    from lightning_plugins.data.image_dataset import build_image_text_dataset, image_text_collator

    main(["tiny", "gemma-3-27b/full_8gpu", "--out", str(tmp_path), "--steps", "3"])
    assert "accelerate launch --config_file accelerate_configs/cpu_2proc.yaml" in capsys.readouterr().out
    twin = load_recipe(tmp_path / "recipe.yaml")
    assert (twin.layout.dp_shard_size, twin.data.format, twin.vision.train_tower, twin.vision.train_projector) == (
        2, "image_text", False, True)  # fmt: skip
    assert twin.memory.activation_checkpointing == "full" and twin.lora is None and twin.train.max_steps == 3
    real = AutoConfig.from_pretrained(ROOT / "recipes" / "configs" / "gemma-3-27b-it")
    config = AutoConfig.from_pretrained(twin.model.path)
    text, vision = config.text_config, config.vision_config
    assert (config.model_type, text.hidden_size, text.num_hidden_layers, vision.hidden_size) == ("gemma3", 128, 2, 32)
    assert set(text.layer_types) == {"sliding_attention", "full_attention"}  # the family's attention pattern kept
    assert (text.query_pre_attn_scalar, vision.hidden_act) == (real.text_config.query_pre_attn_scalar,
                                                                real.vision_config.hidden_act)  # fmt: skip
    processor = AutoProcessor.from_pretrained(twin.model.path)
    rows = build_image_text_dataset(twin.data.resolve(tmp_path), processor, "train")
    assert Path(json.loads(Path(twin.data.train).read_text().splitlines()[0])["images"][0]).is_file()
    batch = image_text_collator(processor)([rows[i] for i in range(4)])
    model = AutoModelForImageTextToText.from_pretrained(twin.model.path)
    projector = model.model.multi_modal_projector.mm_input_projection_weight
    assert bool(projector.any())  # not transformers' zeros: the images reach the language model
    loss = model(**batch).loss
    assert torch.isfinite(loss) and batch["pixel_values"].shape[0] >= 4


@pytest.mark.parametrize("name", QWEN_VL)
def test_qwen_vl_twins_are_refused_only_where_torchvision_fails(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_plugins.cli import main
    from lightning_plugins.planner.model_stats import load_model_config
    from lightning_plugins.recipe.tiny import tiny_config
    from lightning_plugins.recipe.tiny_image_text import tiny_image_text_config

    path = ROOT / "recipes" / f"{name}.yaml"
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `import torchvision` fails, as where it is not installed
    with pytest.raises(SystemExit) as refused:  # the import fails: no processor of the family can be built
        main(["tiny", name, "--out", str(tmp_path)])
    message = str(refused.value)
    assert "is built only with torchvision" in message
    assert "(ModuleNotFoundError: import of torchvision halted" in message  # the import's own error: why it is refused
    assert "pip install torch==2.14.1 torchvision==0.29.1" in message and not (tmp_path / "recipe.yaml").exists()
    # Where it imports (a stand-in module here), the same family is shrunk: refused by the import, not by its name.
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    real = load_model_config(load_recipe(path).model.path, multimodal=True)
    tiny = tiny_image_text_config(real, tiny_config(real.text_config, 2), path)
    shrunk = (tiny.model_type, tiny.text_config.hidden_size, tiny.vision_config.hidden_size)
    assert shrunk == (IMAGE_TEXT[name], 128, 32)


@pytest.mark.torchvision
def test_shipped_qwen_vl_processors_are_the_scripts_and_size_the_shipped_images(tmp_path: Path) -> None:
    import importlib.util

    from PIL import Image
    from transformers import AutoProcessor

    spec = importlib.util.spec_from_file_location("make_tiny_qwen_vl", ROOT / "recipes/tiny/make_tiny_qwen_vl.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for family, name in script.PROCESSOR_DIRS.items():
        script.build_processor(family).save_pretrained(tmp_path / name)
        shipped = ROOT / "recipes" / "tiny" / name
        assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in (tmp_path / name).iterdir())
        for file in shipped.iterdir():  # byte-identical: the shipped files are what the script writes
            assert file.read_bytes() == (tmp_path / name / file.name).read_bytes(), file
        processor = AutoProcessor.from_pretrained(shipped)
        assert type(processor).__name__ == {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[family]
        # The shipped images at their own size: 16 x 16 pixels are 4 x 4 patches, 4 image tokens; 16 x 24 are 6.
        for (height, width), tokens in (((16, 16), 4), ((16, 24), 6), ((24, 16), 6)):
            grid = processor.image_processor(Image.new("RGB", (width, height)))["image_grid_thw"]
            assert grid.tolist() == [[1, height // 4, width // 4]] and int(grid.prod()) // 4 == tokens
        assert processor.tokenizer.bos_token is None and processor.tokenizer.eos_token == "<|im_end|>"


@pytest.mark.torchvision
@pytest.mark.parametrize("name", QWEN_VL)
def test_qwen_vl_twins_are_the_family_shrunk_and_their_rows_run(name: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from lightning_plugins.cli import main
    from lightning_plugins.data.image_dataset import build_image_text_dataset, image_text_collator

    main(["tiny", name, "--out", str(tmp_path), "--steps", "3"])
    twin, real = load_recipe(tmp_path / "recipe.yaml"), load_recipe(ROOT / "recipes" / f"{name}.yaml")
    assert twin.lora is not None and twin.data.format == "image_text" and twin.train.max_steps == 3
    assert (twin.layout.cp_size > 1, twin.layout.ep_size > 1) == (real.layout.cp_size > 1, real.layout.ep_size > 1)
    big = AutoConfig.from_pretrained(ROOT / "recipes" / "configs" / Path(real.model.path).name)
    config = AutoConfig.from_pretrained(twin.model.path)
    text, vision, real_text = config.text_config, config.vision_config, big.text_config
    assert (config.model_type, text.hidden_size, text.num_hidden_layers, vision.depth) == (IMAGE_TEXT[name], 128, 2, 2)
    assert (vision.hidden_act, text.hidden_act) == (big.vision_config.hidden_act, real_text.hidden_act)
    sections = text.rope_parameters["mrope_section"]  # multimodal RoPE kept, its sections scaled to the tiny head
    assert sum(sections) == text.head_dim // 2 and len(sections) == len(real_text.rope_parameters["mrope_section"])
    assert text.rope_parameters.get("mrope_interleaved") == real_text.rope_parameters.get("mrope_interleaved")
    if config.model_type == "qwen2_5_vl":  # window attention in the first block, full in the last
        assert (vision.fullatt_block_indexes, vision.window_size) == ([1], vision.patch_size * 2)
    else:  # deepstack: a merger after each of the 2 blocks, added after each of the 2 decoder layers
        assert vision.deepstack_visual_indexes == [0, 1] and text.num_local_experts == 4
    processor = AutoProcessor.from_pretrained(twin.model.path)
    tokens = processor.tokenizer.convert_tokens_to_ids
    assert config.image_token_id == tokens("<|image_pad|>") and config.video_token_id == tokens("<|video_pad|>")
    assert [config.vision_start_token_id, config.vision_end_token_id] == tokens(["<|vision_start|>", "<|vision_end|>"])
    assert vision.patch_size == processor.image_processor.patch_size and text.vocab_size >= len(processor.tokenizer)
    rows = build_image_text_dataset(twin.data.resolve(tmp_path), processor, "train")
    samples = [rows[i] for i in range(8)]
    assert all(len(s["input_ids"]) <= twin.data.max_seq_len for s in samples)
    for sample in samples:  # one <|image_pad|> per image token: its grid's patches over the 2 x 2 merge
        image_tokens = int((sample["input_ids"] == config.image_token_id).sum())
        assert image_tokens == int(sample["image_grid_thw"].prod(-1).sum()) // 4 and image_tokens in (4, 6, 8, 10, 12)
    batch = image_text_collator(processor)(samples)
    model = AutoModelForImageTextToText.from_pretrained(twin.model.path)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and batch["pixel_values"].shape[0] >= 8 * 16
    assert all(p.grad is not None for n, p in model.named_parameters() if "visual" in n and "merger" in n)
