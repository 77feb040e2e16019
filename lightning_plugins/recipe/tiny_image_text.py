"""The tiny twin of an image-text recipe (:func:`~lightning_plugins.recipe.tiny.shrink_recipe`): the family's whole
model (vision tower, projector, language model) shrunk, the shipped tiny image-text processor beside it, and the
shipped colours-and-shapes images as its data.

What is kept of the real config: the family, and every setting of its language model and tower that is not a size
(norms, activations, RoPE, attention pattern, soft-capping, tying). What changes: the language model as a text twin's
(``tiny_config``, 2 layers), the tower to 2 blocks of width 32 on 16 x 16-pixel
images in 2 x 2 patches, and the vocabulary, special and image token ids to the shipped tiny processor's
(``recipes/tiny/vlm_model``: its tokenizer, chat template and image processor, which load without torchvision).

Families: Gemma 3. Qwen2.5-VL's and Qwen3-VL's processors cannot be built without torchvision (their video processor),
which this package does not install, so their twins are refused with that reason; their layouts train tiny in the
parity tests on generated rows (``tests/multimodal/test_image_text_parity.py``). Not an extra either: the torchvision
that matches torch 2.13.0 on PyPI (0.28.0) is a CUDA build, whose ``_C.so`` links ``libtorch_cuda.so``; beside the CPU
torch the tests run on, ``import torchvision`` fails ("operator torchvision::nms does not exist"). A CPU torchvision
comes from PyTorch's own CPU index.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_plugins.data.tiny import tiny_assets
from lightning_plugins.errors import RecipeError

#: Token rows of a twin: a record with two images is 2 x 18 image tokens plus its text.
TINY_VLM_SEQ_LEN = 96
#: The tower of a twin: 2 blocks of width 32 on 16 x 16-pixel images in 2 x 2 patches (the shipped processor's size).
TINY_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 16, "patch_size": 2}  # fmt: skip
_PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json")
#: The shipped tiny processor's token ids the twin's config takes (the image tokens and the tokenizer's specials).
_TOKEN_KEYS = ("image_token_index", "boi_token_index", "eoi_token_index", "mm_tokens_per_image")
_TEXT_TOKEN_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
_NO_PROCESSOR = {
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_vl_moe": "Qwen3VLProcessor",
}


def _vlm_dir() -> Path:
    return tiny_assets().root / "vlm_model"


def tiny_image_text_config(config: Any, text: Any, path: Path) -> Any:
    """``config`` (a whole image-text config) at tiny size with the shipped tiny processor's tokens, its language
    model ``text`` (the text config shrunk as a text twin's).

    Raises:
        RecipeError: for a family whose tiny twin is not built, naming the recipe file and why.
    """
    from transformers import AutoConfig

    family = getattr(config, "model_type", "?")
    if family in _NO_PROCESSOR:
        raise RecipeError(
            f"{path}: no tiny twin of a {family} image-text recipe: its processor ({_NO_PROCESSOR[family]}) is built"
            " only with torchvision (its video processor), which this package does not install, so no tiny processor"
            " of the family can be written and checked here. Its layouts train tiny on generated rows in"
            " tests/multimodal/test_image_text_parity.py; check its real size with lightning-plugins plan."
        )
    if family != "gemma3":
        raise RecipeError(
            f"{path}: no tiny twin of a {family} image-text recipe yet (twins are built for Gemma 3). Check its real"
            " size with lightning-plugins plan."
        )
    shipped = AutoConfig.from_pretrained(_vlm_dir())
    text = text.to_dict()
    text.update({key: getattr(shipped.text_config, key) for key in _TEXT_TOKEN_KEYS})
    fields = {
        **config.to_dict(),
        "text_config": text,
        "vision_config": {**config.vision_config.to_dict(), **TINY_TOWER},
        **{key: getattr(shipped, key) for key in _TOKEN_KEYS},
        "torch_dtype": "float32",
    }
    fields.pop("quantization_config", None)
    return type(config).from_dict(fields)


def write_image_text_model(config: Any, directory: Path, seed: int) -> None:
    """A random checkpoint of ``config`` with the shipped tiny processor's files in ``directory``."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # transformers starts some projectors at zero (Gemma 3's; a checkpoint's is trained): small random values,
            # so the images reach the language model from the first step, as they do in the real recipe.
            if "projector" in name and not param.any():
                param.normal_(0.0, 0.02)
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        model.save_pretrained(directory)
    finally:
        if bars:
            logging.enable_progress_bar()
    for name in _PROCESSOR_FILES:
        shutil.copy(_vlm_dir() / name, directory / name)


def tiny_image_text_data(split: str, records: int, out: Path) -> Path:
    """The first ``records`` records of the shipped image-text ``split`` under ``out/data``, their images' paths made
    absolute (the images stay where they are shipped)."""
    source = tiny_assets().root / "data" / f"vlm_{split}.jsonl"
    target = out / "data" / f"{split}.jsonl"
    target.parent.mkdir(exist_ok=True)
    lines = []
    with open(source) as handle:
        for _, line in zip(range(records), handle):
            record = json.loads(line)
            record["images"] = [str((source.parent / image).resolve()) for image in record["images"]]
            lines.append(json.dumps(record) + "\n")
    target.write_text("".join(lines))
    return target.resolve()
