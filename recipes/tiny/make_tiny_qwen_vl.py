#!/usr/bin/env python
"""(Re)creates the tiny Qwen-VL processors the image-text twins of the Qwen-VL recipes use (``lightning-plugins tiny``,
``lightning_plugins/recipe/tiny_image_text.py``, which writes each twin's random model next to a copy of them).

Outputs (under ``--out``, default: the directory of this script)::

    qwen2_5_vl_processor/  Qwen2_5_VLProcessor: a character tokenizer, Qwen2VLImageProcessor, Qwen2VLVideoProcessor
    qwen3_vl_processor/    Qwen3VLProcessor (also Qwen3-VL-MoE's): the same tokenizer, Qwen2VLImageProcessor,
                           Qwen3VLVideoProcessor

each as ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` and ``processor_config.json``; no
weights. The tokenizer is make_tiny.py's alphabet, one token per character, with Qwen's special tokens instead of
``<s>``/``</s>``: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS: the end of a turn),
``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``, and a newline;
no BOS (Qwen has none). The chat templates are the families' (``<|im_start|>role\\n...<|im_end|>\\n`` per turn, each
image ``<|vision_start|><|image_pad|><|vision_end|>``, which the processor expands to one ``<|image_pad|>`` per image
token), with ``{% generation %}`` around each assistant turn's content and ``<|im_end|>`` so that only they are
trained. One change: Qwen2.5-VL's template adds the system turn ``You are a helpful assistant.`` to a conversation
without one; this one does not (in a character tokenizer it would be 38 of a twin's 96 tokens; ``Y`` is not in it).

Images: patches of 4x4 pixels, 2 frames (Qwen's ``temporal_patch_size``; an image is repeated), merged 2x2 into one
image token, 64 to 384 pixels: the shipped 16x16 images are 4 image tokens, the 16x24 and 24x16 ones 6, at their own
size. The twins' vision towers use the same patch, merge and temporal sizes.

Usage::

    python recipes/tiny/make_tiny_qwen_vl.py                  # regenerate in place (needs torchvision)
    python recipes/tiny/make_tiny_qwen_vl.py --out /tmp/tiny  # elsewhere
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_tiny import CHARS

#: The directories written, by family (Qwen3-VL-MoE uses Qwen3-VL's processor).
PROCESSOR_DIRS = {"qwen2_5_vl": "qwen2_5_vl_processor", "qwen3_vl": "qwen3_vl_processor"}
TEXT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 64, 384  # one image token at least; the largest shipped image (16x24) at its own size
#: Qwen's images are normalised with CLIP's mean and std (Qwen2.5-VL) or with 0.5 (Qwen3-VL), as the checkpoints say.
NORMALISE = {
    "qwen2_5_vl": ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
    "qwen3_vl": ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]),
}

_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
# A turn's content: a string, or text, image and video entries (numbered with add_vision_id, as Qwen's templates do).
_CONTENT = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}" + _IMAGE +
    "{% elif part['type'] == 'video' or 'video' in part %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}" + _VIDEO +
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)  # fmt: skip
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}" + _CONTENT + "<|im_end|>{% endgeneration %}\n"
    "{% else %}" + _CONTENT + "<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)  # fmt: skip


def build_tokenizer():
    """The character tokenizer with Qwen's special tokens (no BOS; ``<|im_end|>`` ends a turn)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(TEXT_SPECIALS + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>",
        model_max_length=256,
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_SPECIALS]})
    tokenizer.add_tokens(["\n"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(family: str):
    """The tiny ``Qwen2_5_VLProcessor`` (``qwen2_5_vl``) or ``Qwen3VLProcessor`` (``qwen3_vl``); needs torchvision."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    mean, std = NORMALISE[family]
    sizes = {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": TEMPORAL, "image_mean": mean,
             "image_std": std}  # fmt: skip
    pixels = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    image_processor = Qwen2VLImageProcessor(size=pixels, **sizes)
    if family == "qwen2_5_vl":
        video_processor = Qwen2VLVideoProcessor(size=pixels, **sizes)
        return Qwen2_5_VLProcessor(image_processor, build_tokenizer(), video_processor, chat_template=CHAT_TEMPLATE)
    video_processor = Qwen3VLVideoProcessor(size=pixels, **sizes)
    return Qwen3VLProcessor(image_processor, build_tokenizer(), video_processor, chat_template=CHAT_TEMPLATE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    written = {}
    for family, name in PROCESSOR_DIRS.items():
        directory = args.out / name
        directory.mkdir(parents=True, exist_ok=True)
        build_processor(family).save_pretrained(directory)
        written[family] = sorted(path.name for path in directory.iterdir())
    print(json.dumps(written))


if __name__ == "__main__":
    main()
