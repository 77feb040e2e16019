"""The tiny image-text recipes through both doors and the recipe CLI: ``lightning-plugins finetune`` and
``accelerate launch ... -m lightning_plugins.accelerate`` train the tiny Gemma 3 on the shipped images (pixel values
through the collator, the model and the layout) with every step equal (loss, learning rate, gradient norm, held-out
loss); the vision tower stays bit-identical (frozen by default), the projector and language model move; the export is
an HF multimodal directory with its processor that plain transformers loads and generates from. The recipe checks of
the ``vision:`` section and image-text data run fast.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from _launch import ROOT, TINY, accelerate_launch, clean_stdout

from lightning_plugins.errors import RecipeError
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.testing.world import run_command

# peft's get_peft_model reads a transformers attribute deprecated in 5.x: third-party noise.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS = 6
SHORT = [f"--train.max_steps={STEPS}", "--train.log_every=1", "--train.eval_every=3", "--train.checkpoint_every=3",
         "--optim.warmup_steps=2"]  # fmt: skip
COLUMNS = ("train/loss", "train/lr", "train/grad_norm", "val/loss")


def _metrics(out: Path) -> dict[str, list[tuple[int, float]]]:
    with open(out / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {key: [(int(r["step"]), float(r[key])) for r in rows if r.get(key)] for key in COLUMNS}


def _same(got: Path, want: Path) -> None:
    a, b = _metrics(got), _metrics(want)
    for key in COLUMNS:
        assert [s for s, _ in a[key]] == [s for s, _ in b[key]] and b[key], (key, a[key], b[key])
        torch.testing.assert_close(torch.tensor([v for _, v in a[key]]), torch.tensor([v for _, v in b[key]]),
                                   rtol=1e-5, atol=1e-5, msg=key)  # fmt: skip
    assert len(a["train/loss"]) == STEPS and len(a["val/loss"]) == 2


def _export_loads_and_generates(exported: Path) -> None:
    """Plain transformers: the processor and the model from the export; frozen tower as shipped, the rest moved."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lightning_plugins.data.image_text import open_image

    processor = AutoProcessor.from_pretrained(exported)
    model, shipped = (AutoModelForImageTextToText.from_pretrained(d) for d in (exported, TINY / "vlm_model"))
    trained, start = model.state_dict(), shipped.state_dict()
    for part, moved in (("vision_tower", False), ("multi_modal_projector", True), ("language_model", True)):
        same = [torch.equal(trained[k], start[k]) for k in start if f".{part}." in f".{k}"]
        assert same and (not any(same) if moved else all(same)), part
    record = json.loads((TINY / "data" / "vlm_eval.jsonl").read_text().splitlines()[0])
    images = [open_image(path, TINY / "data") for path in record["images"]]
    inputs = processor.apply_chat_template(record["messages"][:1], add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt", processor_kwargs={"images": images})
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["vlm_fsdp2.yaml", "vlm_tp2.yaml"])
def test_both_doors_train_the_tiny_vlm_alike(tmp_path: Path, recipe: str) -> None:
    lightning, accelerate = tmp_path / "lightning", tmp_path / "accelerate"
    command = [sys.executable, "-m", "lightning_plugins", "finetune", str(TINY / recipe),
               f"--train.output_dir={lightning}", *SHORT]  # fmt: skip
    stdout = clean_stdout(run_command(command, cwd=ROOT))
    assert f"model: {lightning / 'hf'}" in stdout
    stdout = clean_stdout(accelerate_launch(TINY / recipe, accelerate, *SHORT))
    assert f"model: {accelerate / 'hf'}" in stdout
    _same(accelerate, lightning)
    _export_loads_and_generates(accelerate / "hf")


@pytest.mark.slow
def test_the_tiny_vlm_recipe_trains_alike_under_pipeline_parallelism(tmp_path: Path) -> None:
    """``--layout.pp_size=2`` on the FSDP2 recipe, through both doors: two pipeline stages (the first holds the vision
    tower and the projector and places the images) train as one process does, step for step, and export a model that
    loads and generates. (One data rank in each: the FSDP2 run's two data ranks draw their rows in another order.)"""
    pipeline, accelerate, one = tmp_path / "pp2", tmp_path / "accelerate_pp2", tmp_path / "one"
    two_stages = ["--layout.pp_size=2", "--layout.dp_shard_size=1"]
    for out, layout in ((pipeline, two_stages), (one, ["--layout.dp_shard_size=1", "--hardware.devices=1"])):
        command = [sys.executable, "-m", "lightning_plugins", "finetune", str(TINY / "vlm_fsdp2.yaml"),
                   f"--train.output_dir={out}", *SHORT, *layout]  # fmt: skip
        stdout = clean_stdout(run_command(command, cwd=ROOT))
        assert f"model: {out / 'hf'}" in stdout
    stdout = clean_stdout(accelerate_launch(TINY / "vlm_fsdp2.yaml", accelerate, *SHORT, *two_stages))
    assert f"model: {accelerate / 'hf'}" in stdout
    _same(pipeline, one)
    _same(accelerate, one)
    _export_loads_and_generates(pipeline / "hf")


def test_vision_keys_and_image_data_are_checked() -> None:
    recipe = load_recipe(TINY / "vlm_fsdp2.yaml")
    assert recipe.vision.trains(lora=False) == (False, True)
    assert load_recipe(TINY / "vlm_fsdp2.yaml", ["vision.train_tower=true"]).vision.trains(lora=False) == (True, True)
    with pytest.raises(RecipeError, match=r"vlm_fsdp2.yaml: vision.train_projector: true .* only the adapters train"):
        load_recipe(TINY / "vlm_fsdp2.yaml", ["lora.r=8"])
    with pytest.raises(RecipeError, match=r"vlm_fsdp2.yaml: data.packing: Gemma 3's image tokens attend to each other both ways"):
        load_recipe(TINY / "vlm_fsdp2.yaml", ["data.packing=true"])
    with pytest.raises(RecipeError, match=r"holds images but model.path=.* without a vision tower"):
        load_recipe(TINY / "vlm_fsdp2.yaml", [f"model.path={TINY / 'model'}"])
    with pytest.raises(RecipeError, match=r"lora_tp2.yaml: vision: the data .* holds no images"):
        load_recipe(TINY / "lora_tp2.yaml", ["vision.train_tower=false"])


@pytest.mark.slow
def test_lora_adapters_of_the_tiny_vlm_load_in_peft(tmp_path: Path) -> None:
    """LoRA on the language model of the tiny VLM (the recipe's vision keys back to their LoRA default) exports an
    adapter directory that peft loads onto the plain multimodal model: every adapter weight equal to the saved one,
    and the adapted logits differ from the base's (``lora_B`` left zero)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "lora"
    command = [sys.executable, "-m", "lightning_plugins", "finetune", str(TINY / "vlm_fsdp2.yaml"), "--lora.r=8",
               "--vision.train_projector=null", f"--train.output_dir={out}", *SHORT]  # fmt: skip
    stdout = clean_stdout(run_command(command, cwd=ROOT))
    assert f"model: {out / 'adapter'}" in stdout
    base = AutoModelForImageTextToText.from_pretrained(TINY / "vlm_model")
    ids = torch.tensor([[1, 24, 5, 6, 7]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, out / "adapter")
        adapted = model(input_ids=ids).logits
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert saved and len(saved) == len(loaded)
    for name, value in saved.items():
        tail = name.split("base_model.model.")[-1]
        match = [v for k, v in loaded.items() if k.replace(".default", "").endswith(tail)]
        assert len(match) == 1 and torch.equal(match[0], value), name
    assert not torch.allclose(plain, adapted)
