"""Packed rows of image-text samples (``data.packing: true``), for the models whose positions allow it.

A packed row is the same model input as its samples only where the model can be told where each sample starts.
transformers' Qwen2.5-VL and Qwen3-VL (dense and MoE) take ``position_ids`` of shape ``[4, rows, tokens]``: row 0 the
text positions, from which (with no ``attention_mask`` and no KV cache) they build the block-diagonal causal mask, and
rows 1-3 the 3-D multimodal RoPE positions, which the model would otherwise compute over the whole row. Here each
sample's 3-D positions are computed by the model's own ``get_rope_index`` on that sample alone (it reads only the
config), and the text positions restart at 0 per sample; each sample's first label is ``-100``, so the previous
sample's last token does not learn to predict it. Images need no change: image tokens are causal like text in these
models, each image's features replace its tokens in row order, and Qwen3-VL's deepstack features are added at the
image tokens' places, so ``pixel_values`` and ``image_grid_thw`` are concatenated in the order the images sit in the
packed rows (row by row, sample by sample), as a padded batch concatenates them.

Other families are refused with the reason (:func:`image_packing_refusal`): Gemma 3's image tokens attend to each other
both ways, an overlay on the causal mask that transformers 5.24 does not compose with packed positions (its masks look
the image blocks up at the per-sample positions instead of the row's), and a family whose positions are not verified
here is not packed on trust.

Design: the packing happens in the collator, over the samples a batch draws. Image-text samples are processed by the
model's processor only when they are drawn (:mod:`lightning_plugins.data.image_text`), so their lengths (image tokens
included) are not known when the dataset is built, and packing there would mean processing every image once before
training. So ``train.micro_batch_size`` still counts samples, and the collator packs them into as few rows of at most
``data.max_seq_len`` tokens as greedy first fit gives (:func:`~lightning_plugins.data.packing.first_fit`: in drawn
order, a sample never split; one longer than ``max_seq_len`` was already refused or cut when it was processed, naming
its ``file:line``), each row's tail padded to the longest row. What packing saves is the padding; the batch's loss is
the per-token loss of its samples, as unpacked. The number of rows varies from batch to batch, which is why pipeline
parallelism (fixed micro-batch shapes) refuses packed image-text rows; context parallelism refuses them too (its image
placement computes the 3-D positions over the whole row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_plugins.data.config import IGNORE_INDEX
from lightning_plugins.data.packing import first_fit
from lightning_plugins.errors import DataError

#: Model types whose packed image-text rows are checked exact against the samples unpacked (tests/multimodal).
PACKABLE = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
#: Per-token inputs: padded at each row's tail with these (``None``: the pad token); the rest are per image.
_PER_TOKEN = {"input_ids": None, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
_DROPPED = ("attention_mask",)  # the packed rows have none: the positions separate the samples


def image_packing_refusal(
    model_type: str | None, cp_size: int = 1, pp_size: int = 1, attn_implementation: str | None = None
) -> str | None:
    """Why packed image-text rows cannot train a ``model_type`` model (``None``: not known yet, checked when the
    collator is built) under this layout and attention, or ``None`` when they can."""
    if model_type == "gemma3":
        return (
            "Gemma 3's image tokens attend to each other both ways (token_type_ids), an overlay on the causal mask that"
            " transformers does not compose with packed positions (its masks look the image blocks up at the"
            " per-sample positions, not the row's), so a packed row would not be the same input as its samples."
        )
    if model_type is not None and model_type not in PACKABLE:
        return (
            f"packed image-text rows are verified for models with causal image tokens and per-sample multimodal"
            f" RoPE positions ({', '.join(PACKABLE)}); a {model_type} model is not packed on trust."
        )
    if attn_implementation in ("flash_attention_2", "flash_attention_3"):
        return (
            f"packed image-text batches carry no sample lengths for {attn_implementation}'s variable-length kernel,"
            " which without them attends across the samples of a row; use model.attn_implementation: sdpa."
        )
    if cp_size > 1:
        return (
            "packed image-text rows are not split by context parallelism yet: its image placement computes the 3-D"
            " positions over the whole row, not per sample."
        )
    if pp_size > 1:
        return (
            "image-text samples are packed per drawn batch into a varying number of rows, and a pipeline's"
            " micro-batches need fixed shapes (and its stages split position_ids along the batch, not its 3-D axis)."
        )
    return None


class RopeIndex:
    """A sample's multimodal RoPE positions as ``model_class.get_rope_index`` computes them for that sample alone.

    ``get_rope_index`` reads only ``self.config`` (and ``self.get_vision_position_ids``), so it runs here on the
    config, without the model's weights, in the data loader's processes.
    """

    def __init__(self, config: Any) -> None:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        self.config, self.model_class = config, MODEL_MAPPING[type(config)]

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.model_class.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, sample: dict[str, Tensor]) -> Tensor:
        """``[3, tokens]`` positions of one unpadded sample (``input_ids``, ``mm_token_type_ids``, its images')."""
        ids = sample["input_ids"][None]
        types = sample.get("mm_token_type_ids")
        if types is None:
            raise DataError(
                "a packed image-text sample needs mm_token_type_ids (which tokens are an image's), as Qwen's processors"
                " give them; this processor gave none."
            )
        positions, _ = self.model_class.get_rope_index(self, ids, mm_token_type_ids=types[None],
                                                      image_grid_thw=sample.get("image_grid_thw"))  # fmt: skip
        return positions[:, 0]


def pack_image_text(
    samples: Sequence[dict[str, Tensor]],
    max_seq_len: int,
    pad_token_id: int,
    rope_index: Callable[[dict[str, Tensor]], Tensor],
) -> dict[str, Tensor]:
    """Packs processed, unpadded samples into rows of at most ``max_seq_len`` tokens (first fit, in order).

    Returns:
        ``input_ids``, ``labels`` and ``mm_token_type_ids`` of ``[rows, longest row]``, ``position_ids`` of
        ``[4, rows, longest row]`` (text positions, then the 3-D ones, each restarting per sample; a row's padded tail
        numbered ``0, 1, ...`` as a sample of its own, labelled ``-100``), no ``attention_mask``, and every per-image
        input (``pixel_values``, ``image_grid_thw``, ...) concatenated in the order its image sits in the rows.

    Raises:
        ValueError: if ``samples`` is empty, a sample is padded or longer than ``max_seq_len``.
    """
    if not samples:
        raise ValueError("cannot pack an empty list of samples")
    if any("attention_mask" in sample and not bool(sample["attention_mask"].all()) for sample in samples):
        raise ValueError("packed samples must be unpadded (an attention_mask of ones), as the processor gives one")
    rows = first_fit([sample["input_ids"].shape[0] for sample in samples], max_seq_len)
    ordered = [samples[i] for members in rows for i in members]  # row by row: the order images are placed in
    width = max(sum(samples[i]["input_ids"].shape[0] for i in members) for members in rows)
    kinds = {key: value.dtype for sample in samples for key, value in sample.items() if key in _PER_TOKEN}
    batch = {key: torch.full((len(rows), width), pad_token_id if _PER_TOKEN[key] is None else _PER_TOKEN[key],
                             dtype=dtype) for key, dtype in kinds.items()}  # fmt: skip
    positions = torch.arange(width).repeat(4, len(rows), 1)
    for row, members in enumerate(rows):
        start = 0
        for i in members:
            sample = samples[i]
            end = start + sample["input_ids"].shape[0]
            for key in kinds.keys() & sample.keys():
                batch[key][row, start:end] = sample[key]
            batch["labels"][row, start] = IGNORE_INDEX  # not predicted from the previous sample's last token
            positions[0, row, start:end] = torch.arange(end - start)
            positions[1:, row, start:end] = rope_index(sample)
            start = end
        positions[:, row, start:] = torch.arange(width - start)
    batch["position_ids"] = positions
    per_image = sorted({key for sample in samples for key in sample} - _PER_TOKEN.keys() - set(_DROPPED))
    for key in per_image:
        batch[key] = torch.cat([sample[key] for sample in ordered if key in sample])
    return batch


def prepare_model_for_image_packing(model: Any, device: str | None = None) -> None:
    """:func:`~lightning_plugins.data.packing.prepare_model_for_packing` for an image-text model, whose language
    model reads ``use_cache`` from its own text config: with it true (the default), the language model makes a KV
    cache in every forward, and transformers then does not look for packed samples in the positions and attends
    across them.

    Raises:
        DataError: for an attention implementation that does not keep packed samples apart (flash attention
            included: packed image-text batches carry no lengths for its variable-length kernel).
    """
    from lightning_plugins.data.packing import prepare_model_for_packing

    prepare_model_for_packing(model, device=device)
    model.config.get_text_config().use_cache = False


def image_packing_collator(processor: Any, config: Any, max_seq_len: int) -> Callable[[list], dict[str, Tensor]]:
    """The collator of packed image-text rows for the model of ``config`` (its ``model_type`` checked), padding with
    ``processor``'s pad token (its EOS when it has none).

    Raises:
        DataError: for a model whose packed image-text rows would not be the same input as its samples.
    """
    import functools

    why = image_packing_refusal(getattr(config, "model_type", None))
    if why is not None:
        raise DataError(f"data.packing: {why} Set data.packing: false.")
    tokenizer = getattr(processor, "tokenizer", processor)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return functools.partial(pack_image_text, max_seq_len=max_seq_len, pad_token_id=pad, rope_index=RopeIndex(config))
