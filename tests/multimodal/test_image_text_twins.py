"""Tiny twins of the shipped image-text recipes (``lightning-plugins tiny``, ``recipe/tiny_image_text.py``): the
Gemma 3 recipe's twin is the family's whole model shrunk with the shipped tiny processor and images, and its rows run
through that model; the Qwen-VL recipes are refused, naming torchvision (their processors need it). The twins train
through both doors in the slow ``tests/recipe/test_recipes.py::test_every_recipe_trains_tiny_through_the_door``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from _launch import ROOT

from lightning_plugins.recipe.schema import load_recipe

IMAGE_TEXT = {"gemma-3-27b/full_8gpu": True, "qwen2.5-vl-7b/lora_1gpu": False, "qwen2.5-vl-7b/lora_32k_cp": False,
              "qwen3-vl-30b-a3b/lora_ep8": False}  # fmt: skip  (name -> has a twin)


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


@pytest.mark.parametrize("name", [name for name, built in IMAGE_TEXT.items() if not built])
def test_qwen_vl_twins_are_refused_naming_torchvision(name: str, tmp_path: Path) -> None:
    from lightning_plugins.cli import main

    with pytest.raises(SystemExit, match=r"its processor \(Qwen.*Processor\) is built only with torchvision"):
        main(["tiny", name, "--out", str(tmp_path)])
    assert not (tmp_path / "recipe.yaml").exists()
