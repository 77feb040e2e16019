"""The tiny twin of an image-text recipe (:func:`~lightning_plugins.recipe.tiny.shrink_recipe`): the family's whole
model (vision tower, projector, language model) shrunk, the family's shipped tiny processor beside it, and the
shipped colours-and-shapes images as its data.

What is kept of the real config: the family, and every setting of its language model and tower that is not a size
(norms, activations, RoPE, attention pattern, soft-capping, tying; Qwen's multimodal RoPE with its sections scaled to
the tiny head, Qwen2.5-VL's window attention with a full-attention last block, Qwen3-VL's deepstack mergers). What
changes: the language model as a text twin's (``tiny_config``, 2 layers), the tower to 2 blocks of width 32, and the
vocabulary, special and image token ids to the shipped tiny processor's (its tokenizer, chat template and image
processor). Gemma 3: 16 x 16-pixel images in 2 x 2 patches, the processor ``recipes/tiny/vlm_model``, which loads
without torchvision. Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE: patches of 4 x 4 pixels and 2 frames merged 2 x 2 into an
image token (4 to 6 per shipped image), the processors ``recipes/tiny/qwen2_5_vl_processor`` and
``recipes/tiny/qwen3_vl_processor`` (``make_tiny_qwen_vl.py``).

A Qwen-VL processor is built only with torchvision (its video processor), which this package does not install: where
``import torchvision`` fails, those twins are refused, naming it and a pair known to work (torch 2.14.1 with
torchvision 0.29.1; the torchvision that matches torch 2.13.0 on PyPI, 0.28.0, is a CUDA build whose ``_C.so`` fails to
load beside the CPU torch: "operator torchvision::nms does not exist"). Their layouts train tiny on generated rows in
``tests/multimodal/test_image_text_parity.py`` either way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_plugins.data.tiny import tiny_assets
from lightning_plugins.errors import RecipeError

#: Token rows of a twin: a record with two images is 2 x 18 image tokens plus its text (Gemma 3; Qwen's are shorter).
TINY_VLM_SEQ_LEN = 96
#: The tower of a twin: 2 blocks of width 32 on 16 x 16-pixel images in 2 x 2 patches (the shipped processor's size).
TINY_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 16, "patch_size": 2}  # fmt: skip
#: A Qwen-VL twin's tower: 2 blocks of width 32; its patch, frame and merge sizes are the shipped processor's.
TINY_QWEN_TOWER = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
_PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json")
#: The shipped tiny processor's token ids the twin's config takes (the image tokens and the tokenizer's specials).
_TOKEN_KEYS = ("image_token_index", "boi_token_index", "eoi_token_index", "mm_tokens_per_image")
_TEXT_TOKEN_KEYS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
#: Each family's shipped tiny processor (under recipes/tiny) and, for Qwen's, its class (built only with torchvision).
PROCESSOR_DIRS = {
    "gemma3": "vlm_model",
    "qwen2_5_vl": "qwen2_5_vl_processor",
    "qwen3_vl": "qwen3_vl_processor",
    "qwen3_vl_moe": "qwen3_vl_processor",
}
NEEDS_TORCHVISION = {
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "qwen3_vl_moe": "Qwen3VLProcessor",
}
#: A Qwen-VL config's token ids, from the shipped processor's tokens (the keys the family's config has are set).
_QWEN_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
}


def processor_dir(family: str) -> Path:
    """The shipped tiny processor of an image-text ``family`` (``model_type``)."""
    return tiny_assets().root / PROCESSOR_DIRS[family]


def tiny_image_text_config(config: Any, text: Any, path: Path) -> Any:
    """``config`` (a whole image-text config) at tiny size with the shipped tiny processor's tokens, its language
    model ``text`` (the text config shrunk as a text twin's).

    Raises:
        RecipeError: for a family whose tiny twin is not built, or a Qwen-VL one where torchvision does not import,
            naming the recipe file and why.
    """
    family = getattr(config, "model_type", "?")
    if family not in PROCESSOR_DIRS:
        raise RecipeError(
            f"{path}: no tiny twin of a {family} image-text recipe yet (twins are built for Gemma 3, Qwen2.5-VL,"
            " Qwen3-VL and Qwen3-VL-MoE). Check its real size with lightning-plugins plan."
        )
    if family in NEEDS_TORCHVISION:
        require_torchvision(path, family)
        return _tiny_qwen_config(config, text)
    from transformers import AutoConfig

    shipped = AutoConfig.from_pretrained(processor_dir(family))
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


def require_torchvision(path: Path, family: str) -> None:
    """Refuses a Qwen-VL twin where ``import torchvision`` fails (its processor cannot be built there).

    Raises:
        RecipeError: naming the recipe file, the import's error and a torch/torchvision pair known to work.
    """
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # a torchvision built for another torch fails with RuntimeError, not ImportError
        raise RecipeError(
            f"{path}: no tiny twin of a {family} image-text recipe here: its processor ({NEEDS_TORCHVISION[family]})"
            f" is built only with torchvision (its video processor), and `import torchvision` fails"
            f" ({type(err).__name__}: {err}). Install a torchvision built for your torch, e.g."
            " `pip install torch==2.14.1 torchvision==0.29.1` (tested; PyPI's 0.28.0 for torch 2.13.0 is a CUDA build"
            " that fails beside a CPU torch). Without it its layouts train tiny on generated rows in"
            " tests/multimodal/test_image_text_parity.py; check its real size with lightning-plugins plan."
        ) from None


def _tiny_qwen_config(config: Any, text: Any) -> Any:
    """A Qwen-VL config at tiny size: the tower's patch, frame and merge sizes and the token ids the shipped
    processor's; multimodal RoPE's sections scaled to the tiny head; Qwen2.5-VL's window attention over one image
    token's patches with the last block full, as the real tower's every eighth; Qwen3-VL's deepstack mergers after
    the first blocks, as many as fit (their features are added after as many of the 2 decoder layers)."""
    from transformers import AutoTokenizer

    directory = processor_dir(config.model_type)
    image = json.loads((directory / "processor_config.json").read_text())["image_processor"]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    text = text.to_dict()
    text.update(vocab_size=-(-len(tokenizer) // 8) * 8, bos_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    rope = dict(text["rope_parameters"])
    rope["mrope_section"] = scaled_sections(rope["mrope_section"], head_dim // 2)
    text["rope_parameters"] = rope
    vision = {key: value for key, value in config.vision_config.to_dict().items()
              if key not in ("spatial_patch_size", "in_chans")}  # fmt: skip  (old spellings of patch_size, in_channels)
    patch, merge = image["patch_size"], image["merge_size"]
    vision.update(TINY_QWEN_TOWER, patch_size=patch, spatial_merge_size=merge, out_hidden_size=text["hidden_size"],
                  temporal_patch_size=image["temporal_patch_size"])  # fmt: skip
    depth = TINY_QWEN_TOWER["depth"]
    if "fullatt_block_indexes" in vision:
        vision.update(fullatt_block_indexes=[depth - 1], window_size=patch * merge)
    if "deepstack_visual_indexes" in vision:
        vision["deepstack_visual_indexes"] = list(range(min(len(vision["deepstack_visual_indexes"]), depth)))
    if "num_position_embeddings" in vision:  # learned positions on a grid of a 16 x 16-pixel image's patches
        vision["num_position_embeddings"] = (TINY_TOWER["image_size"] // patch) ** 2
    fields = {**config.to_dict(), "text_config": text, "vision_config": vision, "torch_dtype": "float32"}
    fields.update({key: tokenizer.convert_tokens_to_ids(token) for key, token in _QWEN_TOKENS.items() if key in fields})
    fields.pop("quantization_config", None)
    return type(config).from_dict(fields)


def scaled_sections(sections: list[int], total: int) -> list[int]:
    """``sections`` (multimodal RoPE's rotary pairs per axis: time, height, width) scaled to sum to ``total``, the
    rounding given to the largest remainders: Qwen2.5-VL's [16, 24, 24] of 64 pairs is [2, 3, 3] of 8."""
    exact = [section * total / sum(sections) for section in sections]
    scaled = [int(value) for value in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: scaled[i] - exact[i])
    for i in by_remainder[: total - sum(scaled)]:
        scaled[i] += 1
    return scaled


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
        shutil.copy(processor_dir(config.model_type) / name, directory / name)


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
