"""Image-text records (TRL's vision format) -> the model's inputs, through the model's own processor.

A record is a conversation whose user turns hold image entries, and the images it shows, in order::

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
     "images": ["vlm_images/0001.png"]}

``images`` holds paths (relative to the data file's directory), or images as a hub dataset gives them (PIL images,
or ``{"bytes", "path"}``). The conversation is rendered by the processor's chat template and processed with the
images by the processor itself (``AutoProcessor``: image tokens expanded, ``pixel_values`` and the model's extra
inputs such as ``image_grid_thw`` or ``token_type_ids``). Only the assistant turns are trained: labels are ``-100``
on everything else, image tokens included. A template with ``{% generation %}`` markers gives the assistant tokens
directly; for one without, each assistant turn's tokens are those the processed conversation gains from the prompt
before the turn to the end of the turn (checked to be prefixes of the whole, else a clear error).

Samples are processed when a batch is drawn (as TRL's vision collator does), so images of any count and size per
sample take no disk; the images' files and the records' structure are checked when the dataset is built, each
problem named by its ``file:line``.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_plugins.data.config import IGNORE_INDEX, DataConfig
from lightning_plugins.errors import DataError

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PART_TYPES = ("text", "image")


def vision_messages(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The ``messages`` of an image-text record, checked: roles, and contents that are strings or lists of
    ``{"type": "text", "text"}`` / ``{"type": "image"}`` entries; an assistant turn to train."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError("field 'messages' must be a non-empty list of {'role', 'content'} objects.")
    clean = []
    for turn, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise DataError(f"messages[{turn}] must be an object with a string 'role' and a 'content'.")
        content = message.get("content")
        if isinstance(content, list):
            content = [_part(turn, k, part) for k, part in enumerate(content)]
        elif not isinstance(content, str):
            raise DataError(f"messages[{turn}].content must be a string or a list of text and image entries.")
        clean.append({"role": message["role"], "content": content})
    if not any(m["role"] == "assistant" for m in clean):
        raise DataError("the conversation has no 'assistant' message, so nothing in it would be trained.")
    return clean


def _part(turn: int, k: int, part: Any) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind not in _PART_TYPES:
        raise DataError(
            f"messages[{turn}].content[{k}] must be {{'type': 'text', 'text': ...}} or {{'type': 'image'}}."
        )
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise DataError(f"messages[{turn}].content[{k}] is a text entry without a string 'text'.")
        return {"type": "text", "text": part["text"]}
    return {"type": "image"}  # the image itself comes from the record's `images`, in order


def image_count(messages: list[dict[str, Any]]) -> int:
    """How many image entries the conversation holds."""
    return sum(part["type"] == "image" for m in messages if isinstance(m["content"], list) for part in m["content"])


def record_images(record: Mapping[str, Any], messages: list[dict[str, Any]]) -> list[Any]:
    """The record's ``images`` (a list, possibly empty), as many as the conversation's image entries."""
    images = record.get("images")
    images = [] if images is None else images
    if not isinstance(images, list):
        images = [images]
    if len(images) != image_count(messages):
        raise DataError(
            f"the conversation holds {image_count(messages)} image entries but 'images' has {len(images)}: give one"
            " image per {'type': 'image'} entry, in order."
        )
    return images


def open_image(value: Any, base_dir: Path | None, verify: bool = False) -> Any:
    """The image ``value`` names, as an RGB PIL image (or only checked, ``verify=True``).

    ``value``: a path (relative to ``base_dir``, the data file's directory), a PIL image, or ``{"bytes", "path"}``
    (a ``datasets`` image column read without decoding).

    Raises:
        DataError: naming the file for a missing or unreadable image.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value if verify else value.convert("RGB")
    if isinstance(value, Mapping) and value.get("bytes") is not None:
        source, name = io.BytesIO(value["bytes"]), value.get("path") or "image bytes"
    elif isinstance(value, (str, Mapping)):
        path = Path(value if isinstance(value, str) else str(value.get("path")))
        source = name = path if path.is_absolute() or base_dir is None else base_dir / path
        if not path or not Path(source).is_file():
            raise DataError(f"image {str(value)!r}: {source} does not exist (paths are relative to the data file).")
    else:
        raise DataError(f"an image must be a path, a PIL image or {{'bytes', 'path'}}, got a {type(value).__name__}.")
    try:
        image = Image.open(source)
        if verify:
            image.verify()  # reads the whole file: a truncated or corrupt one fails here, not mid-run
            return image
        return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise DataError(f"image {name} cannot be read ({type(err).__name__}: {err}). Replace or drop it.") from None


def encode_image_text(
    record: Mapping[str, Any], processor: Any, config: DataConfig, base_dir: Path | None
) -> dict[str, torch.Tensor] | None:
    """One record as the model's inputs: ``input_ids``, ``attention_mask``, ``labels`` (assistant turns only) and the
    processor's image inputs (``pixel_values``, ``image_grid_thw``, ``token_type_ids``, ...), unbatched.

    Returns ``None`` when truncation leaves no trained token.

    Raises:
        DataError: for a malformed record, a missing or unreadable image, a processor without a chat template, or
            a sample longer than ``max_seq_len`` whose cut would split an image's tokens (or ``truncation: error``).
    """
    messages = vision_messages(record)
    images = [open_image(value, base_dir) for value in record_images(record, messages)]
    template = getattr(processor, "chat_template", None)
    if not template:
        raise DataError(
            f"the processor of {getattr(processor, 'name_or_path', '') or 'the model'} has no chat template, so"
            " conversations cannot be rendered; add a chat_template.jinja to the model directory."
        )
    if isinstance(template, str) and _GENERATION_TAG.search(template):
        out = _process(processor, messages, images, assistant_mask=True)
        mask = out.pop("assistant_masks").bool()
    else:
        out = _process(processor, messages, images)
        mask = _assistant_mask_from_prefixes(processor, messages, images, out["input_ids"])
    labels = out["input_ids"].masked_fill(~mask, IGNORE_INDEX)
    return _fit(dict(out, labels=labels), config, processor)


def _process(processor: Any, messages: list, images: list, assistant_mask: bool = False, prompt: bool = False) -> dict:
    """The processor's inputs for the conversation, unbatched (one sample)."""
    out = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=prompt,
        return_assistant_tokens_mask=assistant_mask, processor_kwargs={"images": images} if images else {},
    )  # fmt: skip
    rows = out["input_ids"].shape  # [1, tokens]: the per-token inputs have it, the per-image ones do not
    return {key: value[0] if value.shape == rows else value for key, value in out.items()}


def _assistant_mask_from_prefixes(processor: Any, messages: list, images: list, ids: torch.Tensor) -> torch.Tensor:
    """Assistant tokens for a template without ``{% generation %}``: the tokens each assistant turn adds."""
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        shown = image_count(messages[:turn])
        before = _process(processor, messages[:turn], images[:shown], prompt=True)["input_ids"]
        upto = _process(processor, messages[: turn + 1], images[:shown])["input_ids"]
        if not (len(before) <= len(upto) <= len(ids) and torch.equal(ids[: len(upto)], upto)
                and torch.equal(ids[: len(before)], before)):  # fmt: skip
            raise DataError(
                f"the processor's chat template renders the conversation up to messages[{turn}] differently from the"
                " start of the whole conversation, so the assistant tokens cannot be located. Add {% generation %}..."
                "{% endgeneration %} around assistant content in the template."
            )
        mask[len(before) : len(upto)] = True
    return mask


def image_token_id(processor: Any) -> int | None:
    """The id of the token each image's features replace (``<image_soft_token>``, ``<|image_pad|>``)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    token = getattr(tokenizer, "image_token", None) or getattr(processor, "image_token", None)
    return None if token is None else tokenizer.convert_tokens_to_ids(token)


def _fit(sample: dict[str, torch.Tensor], config: DataConfig, processor: Any) -> dict[str, torch.Tensor] | None:
    """Applies ``max_seq_len``: a cut that keeps every image token whole, or a clear error."""
    n = sample["input_ids"].shape[0]
    if n > config.max_seq_len:
        image = image_token_id(processor)
        cut = image is not None and bool((sample["input_ids"][config.max_seq_len :] == image).any())
        if config.truncation == "error" or cut:
            why = " and the cut would split an image's tokens from its pixels" if cut else ""
            raise DataError(
                f"{n} tokens (images included), longer than data.max_seq_len={config.max_seq_len}{why}. Raise"
                " data.max_seq_len, or shorten or drop the record."
            )
        sample = {key: value[: config.max_seq_len] if value.shape == (n,) else value for key, value in sample.items()}
    if bool((sample["labels"] == IGNORE_INDEX).all()):
        return None
    return sample
