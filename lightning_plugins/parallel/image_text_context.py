"""Context parallelism for image-text models: the images are placed into the whole sequence, then it is sharded.

An image-text model places its image embeddings into the sequence inside its own forward (the vision tower encodes
``pixel_values``, the features replace the image tokens' embeddings by ``masked_scatter``) and computes the positions
there (Qwen's multimodal RoPE: 3-D position ids from ``get_rope_index`` over the whole row). A text batch is sharded
before the model runs; an image-text batch cannot be, since a shard's image tokens would not match its images and
an image may straddle shards. So, under context parallelism:

* the batch (:func:`shard_image_text_batch`, which :func:`~lightning_plugins.parallel.context.batch.
  shard_batch_for_context_parallel` calls for a batch holding ``pixel_values``) keeps the model's per-token inputs
  whole (``input_ids``, ``attention_mask``, ``mm_token_type_ids``: left padding rolled to the end, padded to a multiple
  of ``2 * cp``) and shards the targets (``labels`` and the next-token ``shift_labels``) as for a text batch;
* every cp rank runs the vision tower on all of its rows' images (the tower's weights are sharded by FSDP2 over the
  data ranks like any other: each cp rank's gradient is its own tokens' part), the model places them and computes
  its positions on the whole sequence, and a forward pre-hook on the language model (:class:`ShardAfterImages`)
  takes this rank's load-balanced shard of the embeddings, the position ids (all of their rows) and Qwen3-VL's
  deepstack features and their mask before the first decoder layer; the attention mask is dropped, as for text.

A batch without images (a text-only micro-batch of an image-text dataset) is sharded as a text batch, less its
``mm_token_type_ids`` (all text; the model reads them only with images). The logits, and so the loss, are this
rank's shard's, as for a text model. A model whose image tokens attend each other
both ways (Gemma 3 marks them with ``token_type_ids``) is refused: context-parallel attention is causal.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.image_text import ImageTextParts

__all__ = [
    "ShardAfterImages",
    "check_image_text_context",
    "context_sharding",
    "holds_images",
    "shard_image_text_batch",
    "without_image_types",
]

#: Batch keys that carry images (or videos): such a batch is sharded by the model, after the images are placed.
IMAGE_KEYS = ("pixel_values", "pixel_values_videos")
#: Per-token keys the model reads on the whole sequence, and the value their padding takes.
_WHOLE_KEYS = {"attention_mask": 0, "mm_token_type_ids": 0}


def holds_images(batch: Any) -> bool:
    """Whether ``batch`` (a mapping) carries images or videos for an image-text model."""
    return isinstance(batch, Mapping) and any(batch.get(key) is not None for key in IMAGE_KEYS)


def without_image_types(batch: Any) -> Any:
    """A batch without images, less its ``mm_token_type_ids`` (all text: the model reads them only with images), so
    that it is sharded as a text batch; any other batch as it is."""
    if isinstance(batch, Mapping) and not holds_images(batch) and "mm_token_type_ids" in batch:
        return {key: value for key, value in batch.items() if key != "mm_token_type_ids"}
    return batch


def check_image_text_context(model: nn.Module) -> None:
    """Refuse context parallelism for an image-text model whose image tokens attend each other both ways.

    Raises:
        LayoutError: naming the model and the layouts that run it.
    """
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        raise LayoutError(
            f"cp_size > 1 is not supported for {type(model).__name__}: its image tokens attend each other both ways"
            " (marked by token_type_ids), and context-parallel attention is causal. Use FSDP2 (dp_shard_size) and"
            " tensor parallelism (tp_size) for this model."
        )


def shard_image_text_batch(
    batch: Mapping[str, Any], cp_rank: int, cp_size: int, multiple: int, pad_token_id: int, ignore_index: int
) -> dict[str, Any]:
    """An image-text batch for context parallelism: the model's per-token inputs whole, the targets sharded.

    Rows are checked and left padding is rolled to the end exactly as for a text batch; the sequence is padded to a
    multiple of ``multiple`` (pads: ``pad_token_id``, attention mask 0, text type, ignored targets).

    Raises:
        ValueError: for ``position_ids`` (packed image-text rows), ``token_type_ids`` (image tokens that attend both
            ways), ``inputs_embeds``, or a per-token key this does not know.
    """
    from lightning_plugins.parallel.context.padding import check_padding, real_tokens_first
    from lightning_plugins.parallel.context.sharding import shard_sequence_load_balanced

    input_ids = _checked_image_text_ids(batch)
    rows, seq_len = input_ids.shape
    labels, shift_labels = batch.get("labels"), batch.get("shift_labels")
    derived = shift_labels is None and labels is not None
    if derived:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    whole = {"input_ids": input_ids} | {key: batch[key] for key in _WHOLE_KEYS if batch.get(key) is not None}
    if (mask := batch.get("attention_mask")) is not None:
        keep = check_padding(mask, labels, None if derived else shift_labels, rows, seq_len, ignore_index)
        if derived:  # a pad predicts nothing (the last left pad would predict the first real token)
            shift_labels = shift_labels.masked_fill(~keep, ignore_index)
        order, _ = real_tokens_first(keep, torch.arange(seq_len, device=keep.device).expand(rows, seq_len))
        whole = {key: value.gather(1, order) for key, value in whole.items()}
        labels, shift_labels = (None if x is None else x.gather(1, order) for x in (labels, shift_labels))
    pad = -seq_len % multiple
    fills = {"input_ids": pad_token_id, **_WHOLE_KEYS}
    out = {key: value for key, value in batch.items() if key not in ("labels", "shift_labels", *whole)}
    out |= {key: F.pad(value, (0, pad), value=fills[key]) for key, value in whole.items()}
    for key, targets in (("shift_labels", shift_labels), ("labels", labels)):
        if targets is not None:
            out[key] = shard_sequence_load_balanced(F.pad(targets, (0, pad), value=ignore_index), -1, cp_rank, cp_size)
    return out


def _checked_image_text_ids(batch: Mapping[str, Any]) -> Tensor:
    """The batch's ``input_ids`` once the batch holds no key this sharding cannot reproduce."""
    refused = {
        "inputs_embeds": "pass token ids: the model places the images into their embeddings",
        "position_ids": "packed image-text rows are not supported under context parallelism yet; the model computes"
        " each row's positions (its multimodal RoPE included) from input_ids",
        "token_type_ids": "they mark image tokens that attend each other both ways (Gemma 3), and context-parallel"
        " attention is causal",
    }
    for key, why in refused.items():
        if batch.get(key) is not None:
            raise ValueError(f"An image-text batch under context parallelism cannot hold `{key}`: {why}.")
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2:
        raise ValueError("Context parallelism needs `input_ids` of shape [batch, seq] in the batch.")
    known = ("input_ids", "labels", "shift_labels", *_WHOLE_KEYS)
    for name, value in batch.items():
        per_token = isinstance(value, Tensor) and value.shape[:2] == input_ids.shape
        if per_token and name not in (*known, *IMAGE_KEYS):
            raise ValueError(
                f"Batch key {name!r} has shape {tuple(value.shape)}, one entry per token, and context parallelism"
                f" does not know how to shard it. Supported per-token keys of an image-text batch: {known}."
            )
    return input_ids


#: Where a model keeps its :class:`ShardAfterImages`.
_SHARDING_ATTR = "_lightning_plugins_shard_after_images"


def context_sharding(model: nn.Module) -> ShardAfterImages | None:
    """The :class:`ShardAfterImages` installed on ``model`` (``None`` without context parallelism)."""
    return model.__dict__.get(_SHARDING_ATTR)


class ShardAfterImages:
    """Forward pre-hooks that shard an image-text model's sequence over ``cp`` after its images are placed.

    One hook on the model notes whether the call carries images (then its batch is whole: see
    :func:`shard_image_text_batch`; a text-only batch comes sharded as for a text model); one on the language model
    takes this rank's load-balanced shard of what the model computed on the whole sequence.
    """

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        self.mesh, self.whole = cp_mesh, False

    def install(self, model: nn.Module, parts: ImageTextParts) -> None:
        """Hook ``model`` (the ``...ForConditionalGeneration``) and its language model; ``model`` keeps this
        (:func:`context_sharding`: pipeline stages say themselves whether what reaches the language model is whole)."""
        model.register_forward_pre_hook(self.note, with_kwargs=True)
        model.get_submodule(parts.language_path).register_forward_pre_hook(self.shard, with_kwargs=True)
        model.__dict__[_SHARDING_ATTR] = self

    def cut(self, x: Tensor, dim: int) -> Tensor:
        """This rank's load-balanced shard of ``x`` along ``dim`` (a whole sequence)."""
        from lightning_plugins.parallel.context.sharding import shard_sequence_load_balanced

        return shard_sequence_load_balanced(x, dim, self.mesh.get_local_rank(), self.mesh.size())

    def note(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.whole = holds_images(kwargs)

    def shard(self, language: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if not self.whole:
            return None
        self.whole = False
        cut = self.cut
        embeds = kwargs["inputs_embeds"]
        rows, seq_len = embeds.shape[:2]
        positions = kwargs.get("position_ids")
        if positions is None:  # one row of text positions, as the language model would count them
            positions = torch.arange(seq_len, device=embeds.device).expand(rows, seq_len)
        kwargs |= {"inputs_embeds": cut(embeds, 1), "position_ids": cut(positions, -1), "attention_mask": None}
        if (visual := kwargs.get("visual_pos_masks")) is not None:  # Qwen3-VL's deepstack: features of image tokens
            slot = torch.full(visual.shape, -1, dtype=torch.long, device=visual.device)
            slot[visual] = torch.arange(int(visual.sum()), device=visual.device)
            local = cut(slot, 1)
            kwargs["visual_pos_masks"] = local >= 0
            if (features := kwargs.get("deepstack_visual_embeds")) is not None:
                kwargs["deepstack_visual_embeds"] = [f[local[local >= 0]] for f in features]
        return args, kwargs
