#!/usr/bin/env python
"""(Re)creates the tiny image-text assets: a tiny Gemma 3 checkpoint with its processor, and a toy image task.

Outputs (under ``--out``, default: the directory of this script)::

    vlm_model/        config.json, generation_config.json, model.safetensors (Gemma3ForConditionalGeneration, random
                      init), the character tokenizer of make_tiny.py plus Gemma 3's image tokens and a newline, a chat
                      template whose messages hold image entries, processor_config.json (Gemma 3's image processor:
                      16x16 pixels, patches of 2x2, 16 image tokens per image)
    data/vlm_images/  PNGs of one coloured shape on a dark background (16x16, 16x24 or 24x16 pixels: the processor resizes)
    data/vlm_train.jsonl, data/vlm_eval.jsonl
                      TRL's vision format: {"messages": [{"role": "user", "content": [{"type": "image"},
                      {"type": "text", "text": "colour"}]}, {"role": "assistant", "content": [{"type": "text",
                      "text": "red"}]}], "images": ["vlm_images/train_0000_0.png"]}

The task: name the colour (``colour``), the shape (``shape``) or both (``both``: ``red circle``) of the image; a
quarter of the records hold two images and ask ``colours`` (``red blue``). Everything is deterministic (fixed seeds,
no downloads); the eval images are drawn with their own seed.

Usage::

    python recipes/tiny/make_tiny_vlm.py                  # regenerate in place
    python recipes/tiny/make_tiny_vlm.py --out /tmp/tiny  # elsewhere
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_tiny import BOS, EOS, PAD, SEED, build_tokenizer, write_jsonl

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle", "cross", "bar")
SIZES = ((16, 16), (16, 24), (24, 16))  # (height, width) in pixels; the processor resizes to 16x16
N_TRAIN, N_EVAL = 320, 64
#: Gemma 3's image tokens: the chat template writes ``<start_of_image>`` per image; the processor expands it into
#: ``\n\n<start_of_image>`` + ``IMAGE_TOKENS`` x ``<image_soft_token>`` + ``<end_of_image>\n\n``.
VISION_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
IMAGE_SIZE, PATCH, IMAGE_TOKENS = 16, 2, 16  # 8x8 patches pooled to 4x4 image tokens

# u:<image><text>| per user turn, a:<answer></s> per assistant turn (inside {% generation %}).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "a:{% generation %}{% for part in parts %}{{ part['text'] }}{% endfor %}{{ eos_token }}{% endgeneration %}"
    "{% elif message['role'] == 'user' %}u:"
    "{% for part in parts %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}|"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def build_processor():
    """The tiny tokenizer with the image tokens and a newline, Gemma 3's image processor (16x16 pixels, no pan and
    scan) and the chat template, as a ``Gemma3Processor``."""
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    base = build_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", model_max_length=256, extra_special_tokens=VISION_TOKENS,
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS.values())})
    tokenizer.add_tokens(["\n"])
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Gemma3Processor(image_processor, tokenizer, chat_template=CHAT_TEMPLATE, image_seq_length=IMAGE_TOKENS)


def build_model(tokenizer):
    """The randomly initialised tiny Gemma3ForConditionalGeneration (seeded)."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKENS.items()}
    config = Gemma3Config(
        text_config={
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": -(-len(tokenizer) // 8) * 8,
            "max_position_embeddings": 256, "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
            "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
        },
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": IMAGE_SIZE, "patch_size": PATCH},
        mm_tokens_per_image=IMAGE_TOKENS, image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"], tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = Gemma3ForConditionalGeneration(config)
    # transformers starts Gemma 3's projection at zero (a checkpoint's is trained): small random values, so the images
    # reach the language model from the first step.
    weight = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        weight.normal_(0.0, 0.02)
    for key, value in (("bos_token_id", BOS), ("eos_token_id", EOS), ("pad_token_id", PAD)):
        setattr(model.generation_config, key, value)
    return model


def draw(colour: str, shape: str, size: tuple[int, int], rng: random.Random):
    """One PNG-ready image: the shape in the colour, placed at a random offset on a dark, slightly varied ground."""
    from PIL import Image, ImageDraw

    height, width = size
    ground = tuple(rng.randint(0, 40) for _ in range(3))
    image = Image.new("RGB", (width, height), ground)
    pen = ImageDraw.Draw(image)
    side = rng.randint(9, 12)
    x, y = rng.randint(0, width - side), rng.randint(0, height - side)
    fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    box = (x, y, x + side - 1, y + side - 1)
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "cross":
        third = side // 3
        pen.rectangle((x + third, y, x + side - 1 - third, y + side - 1), fill=fill)
        pen.rectangle((x, y + third, x + side - 1, y + side - 1 - third), fill=fill)
    else:  # a horizontal bar
        pen.rectangle((x, y + side // 3, x + side - 1, y + side - 1 - side // 3), fill=fill)
    return image


def make_split(name: str, n: int, seed: int, images_dir: Path) -> list[dict]:
    """``n`` records of ``name`` (``train``/``eval``), their images written to ``images_dir``."""
    rng = random.Random(seed)
    records = []
    for index in range(n):
        count = 2 if rng.random() < 0.25 else 1
        drawn = [(rng.choice(sorted(COLOURS)), rng.choice(SHAPES)) for _ in range(count)]
        paths = []
        for k, (colour, shape) in enumerate(drawn):
            relative = f"{images_dir.name}/{name}_{index:04d}_{k}.png"
            draw(colour, shape, rng.choice(SIZES), rng).save(images_dir.parent / relative, optimize=True)
            paths.append(relative)
        if count == 2:
            question, answer = "colours", " ".join(colour for colour, _ in drawn)
        else:
            question = rng.choice(("colour", "shape", "both"))
            colour, shape = drawn[0]
            answer = {"colour": colour, "shape": shape, "both": f"{colour} {shape}"}[question]
        content = [{"type": "image"} for _ in paths] + [{"type": "text", "text": question}]
        records.append({
            "messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "images": paths,
        })  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    processor = build_processor()
    model_dir = args.out / "vlm_model"
    model_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(model_dir)
    build_model(processor.tokenizer).save_pretrained(model_dir)
    images_dir = args.out / "data" / "vlm_images"
    images_dir.mkdir(parents=True, exist_ok=True)
    for stale in images_dir.glob("*.png"):
        stale.unlink()
    write_jsonl(args.out / "data" / "vlm_train.jsonl", make_split("train", N_TRAIN, SEED + 7, images_dir))
    write_jsonl(args.out / "data" / "vlm_eval.jsonl", make_split("eval", N_EVAL, SEED + 8, images_dir))
    print(json.dumps({"model": str(model_dir), "images": len(list(images_dir.glob("*.png")))}))


if __name__ == "__main__":
    main()
