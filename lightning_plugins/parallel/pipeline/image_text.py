"""Pipeline stages of an image-text model: its own forward runs up to its language model on every stage.

An image-text model's forward (``...ForConditionalGeneration`` -> its multimodal base model) embeds the tokens, runs
the vision tower and projector on ``pixel_values``, places the image features where the image tokens are
(``masked_scatter``), may build the language model's masks (Gemma 3: image tokens attend each other both ways, a mask
mapping per attention type) and computes the positions (Qwen's 3-D multimodal RoPE, from ``get_rope_index``), then
calls its language model. A stage reproduces that by running the multimodal base model's own forward until it calls the
language model (:class:`ImageTextPrelude`: a pre-hook on the language model takes what it was given and stops the
forward), so no family's placement or masking is copied here:

* the first stage holds the vision tower and the projector (the other stages drop them) and calls the forward with its
  micro-batch's token ids and images: the hidden states it sends on are the language model's ``inputs_embeds``;
* every other stage calls it with the hidden states it received as ``inputs_embeds`` and no images, for the mask
  mapping (a causal mask is built by the stage from the padding mask, as the language model would);
* positions are computed once per batch on every rank from the whole rows (the model's ``compute_3d_position_ids``
  where it has one: :func:`hand_batch_to_stages`; for a batch without images ``0 .. seq-1``, as its language model
  counts them), and each micro-batch takes its rows' positions.

Images belong to rows. The schedule splits tensors along their first dimension, which for ``pixel_values`` counts
images (Gemma 3) or patches (Qwen, with ``image_grid_thw`` giving each image's grid), not rows; so the whole batch is
handed to the stages before the step and each micro-batch takes its own rows' images by the row indices the schedule
splits (``rows``). Each image's number of tokens is its grid's patches over the merge area (``spatial_merge_size ** 2``)
with ``image_grid_thw``, else the row's image tokens split evenly over the ``pixel_values`` entries.

Deepstack (Qwen3-VL, dense and MoE): the multimodal forward also hands its language model a feature per image token
for each of its first ``K`` decoder layers (``deepstack_visual_embeds``; ``K`` is
``len(vision_config.deepstack_visual_indexes)``) and the image tokens' mask (``visual_pos_masks``); after layer
``k < K`` the language model adds feature ``k`` to the image tokens' hidden states (``_deepstack_process``). The first
stage computes them with the images; it adds those of its own layers with the language model's ``_deepstack_process``
(:meth:`ImageTextPrelude.after_layer`) and sends the others on beside the hidden states
(:meth:`ImageTextPrelude.pack`): each as a ``[rows, seq, hidden]`` tensor that holds the feature at its image token and
zero elsewhere, concatenated to the hidden states along the last dimension (one boundary tensor of static shape,
``hidden x (1 + features still to add)``, whatever a micro-batch's image tokens). A later stage adds its layers'
features as ``hidden + feature``, which at an image token is the language model's own sum and elsewhere adds zero: the
same values, and the same gradients back to the first stage's vision tower and mergers.

Tensor parallelism: the first stage's tensor-parallel ranks run the replicated tower on the same images
(:mod:`lightning_plugins.parallel.replicated_tower`); the stages are the text decoder's. Context parallelism
(:mod:`lightning_plugins.parallel.image_text_context`): a batch with images comes with its tokens (and per-row inputs)
whole and its targets sharded; the first stage's model places the images and its language model's hook
(``ShardAfterImages``, told by the prelude that this call's sequence is whole) takes this rank's shard of the
embeddings, positions and deepstack features, so the stage sends its shard on. A later stage, whose hidden states arrive
sharded, takes its shard of the rows' positions (from the whole rows, computed once per batch) and no attention mask,
as the first stage's language model got them. The boundaries are sized by the targets' tokens (``Pipeline``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_plugins.errors import LayoutError, LightningPluginsError
from lightning_plugins.parallel.image_text import ImageTextParts

__all__ = ["ImageTextPrelude", "check_stageable_language_model", "deepstack_count", "hand_batch_to_stages"]

#: What a language model's forward may take that a stage gives it (or that does not act in training).
_LANGUAGE_INPUTS = {
    "input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "inputs_embeds", "use_cache",
    "cache_position", "kwargs", "self",
}  # fmt: skip
#: The batch keys that hold images (their first dimension counts images or patches, not rows).
IMAGE_INPUTS = ("pixel_values", "image_grid_thw")
#: Video inputs, which no stage places yet.
_VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
#: What a language model with deepstack takes from the multimodal forward (see the module doc).
_DEEPSTACK_INPUTS = {"deepstack_visual_embeds", "visual_pos_masks"}


class _Reached(LightningPluginsError):
    """Raised by the language model's pre-hook: the multimodal forward has done its part."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("the language model was reached")
        self.kwargs = kwargs


def check_stageable_language_model(language: nn.Module, config: Any, pp_size: int) -> None:
    """Refuse a language model whose forward takes inputs the multimodal forward computes and a stage would not pass
    on: anything but deepstack features (Qwen3-VL's, carried to the stages holding the layers they are added to) of a
    language model that adds them with ``_deepstack_process`` and a config that counts them.

    Raises:
        LayoutError: naming the inputs.
    """
    extra = set(inspect.signature(language.forward).parameters) - _LANGUAGE_INPUTS
    deepstack = hasattr(language, "_deepstack_process") and deepstack_count(config) is not None
    if deepstack and _DEEPSTACK_INPUTS <= extra:
        extra -= _DEEPSTACK_INPUTS
    if extra:
        raise LayoutError(
            f"pp_size={pp_size}: the language model of this image-text model ({type(language).__name__}) takes"
            f" {sorted(extra)} from the multimodal forward, which pipeline stages do not carry to the stage holding"
            " the layers that use them (stages carry only deepstack features that a language model adds with"
            " `_deepstack_process` and its vision config counts in `deepstack_visual_indexes`, as Qwen3-VL's)."
            " Use pp_size=1 for this model (FSDP2, tensor, context or expert parallelism)."
        )


def deepstack_count(config: Any) -> int | None:
    """How many deepstack features an image-text config's vision tower gives (added after the language model's first
    layers, one each); ``None`` when its config does not say."""
    vision = getattr(config, "vision_config", None)
    indexes = getattr(vision, "deepstack_visual_indexes", getattr(config, "deepstack_visual_indexes", None))
    return None if indexes is None else len(indexes)


class ImageTextPrelude(nn.Module):
    """What an image-text model's forward does before its language model, for one stage (see the module doc).

    The first stage's prelude holds the vision tower and the projector as submodules (the stage owns their
    parameters); every prelude calls the multimodal base model (held outside its module tree).
    """

    def __init__(
        self, model: nn.Module, parts: ImageTextParts, first: bool, layers: range | None = None, context: Any = None
    ) -> None:
        super().__init__()
        base_path = parts.language_path.rpartition(".")[0]
        self.__dict__["base"] = model.get_submodule(base_path) if base_path else model
        self.__dict__["language"] = model.get_submodule(parts.language_path)
        self.__dict__["config"] = model.config
        self.vision = model.get_submodule(parts.vision_path) if first else None
        projectors = [model.get_submodule(path) for path in parts.projector_paths]
        self.projectors = nn.ModuleList(projectors) if first else None
        self.__dict__["units"] = parts.vision_units(model) if first else []
        self._batch: dict[str, Any] = {}
        self.first = first
        #: Under context parallelism, the model's :class:`~lightning_plugins.parallel.image_text_context.
        #: ShardAfterImages` (see the module doc); ``None`` without.
        self.__dict__["context"] = context
        count = deepstack_count(model.config) if hasattr(self.language, "_deepstack_process") else None
        layers = layers if layers is not None else range(0)
        #: Deepstack features this stage receives (for layers ``layers.start ...``) and sends on (``layers.stop ...``).
        self.carried_in = 0 if first or not count else max(0, count - layers.start)
        self.carried_out = max(0, (count or 0) - layers.stop)
        self._layers = layers
        #: The current micro-batch's deepstack features by layer index, and the image tokens' mask (first stage).
        self._features: dict[int, Tensor] = {}
        self._mask: Tensor | None = None

    def vision_units(self) -> list[nn.Module]:
        """The vision blocks and projector modules this stage holds, each an FSDP2 unit of its own."""
        return list(self.units)

    def set_batch(self, input_ids: Tensor, per_row: dict[str, Tensor], images: dict[str, Tensor]) -> None:
        """The whole batch's inputs that the schedule does not split: per-row tensors (positions first dimension
        rows) and the images, assigned to their rows."""
        # Under context parallelism a batch with images comes whole (its targets sharded): the first stage's model
        # shards it once the images are placed, later stages take their shard of the per-row inputs.
        whole = self.context is not None and bool(images)
        self._batch = {"rows": input_ids.shape[0], "per_row": per_row, "images": images, "whole": whole}
        if self.vision is not None and images:
            self._batch["table"] = _image_table(self.config, input_ids, images)

    def forward(
        self, inputs: Tensor, attention_mask: Tensor | None, rows: Tensor
    ) -> tuple[Tensor, Tensor | dict | None, Tensor | None]:
        """``(inputs_embeds, attention_mask or mask mapping, position_ids)`` as the language model would get them."""
        rows = rows.clamp(max=self._batch["rows"] - 1)  # evaluation's copies of the last row repeat it
        kwargs: dict[str, Any] = {key: value[rows] for key, value in self._batch["per_row"].items()}
        if (positions := kwargs.get("position_ids")) is not None and positions.ndim == 3:
            kwargs["position_ids"] = positions.transpose(0, 1)  # carried rows first: [axes, rows, seq] again
        kwargs["attention_mask"] = attention_mask
        self._features, self._mask = {}, None
        if self.vision is not None:
            kwargs["input_ids"] = inputs
            if "table" in self._batch:
                kwargs |= _rows_images(self._batch["images"], self._batch["table"], rows.tolist())
        else:
            kwargs["inputs_embeds"] = self._unpack(inputs)
            if self._batch["whole"]:
                kwargs |= self._shard_per_row(kwargs, inputs)
        if self.context is not None:  # the language model's hook shards what the first stage's model placed
            self.context.whole = self._batch["whole"] and self.vision is not None

        def reached(module: nn.Module, args: tuple, given: dict[str, Any]) -> None:
            raise _Reached(given)

        handle = self.language.register_forward_pre_hook(reached, with_kwargs=True)
        try:
            self.base(**kwargs, use_cache=False)
        except _Reached as stop:
            given = stop.kwargs
        else:
            raise RuntimeError(f"{type(self.base).__name__}'s forward did not call its language model.")
        finally:
            handle.remove()
            if self.context is not None:
                self.context.whole = False
        if self.first and given.get("deepstack_visual_embeds") is not None:
            self._features = dict(enumerate(given["deepstack_visual_embeds"]))
            self._mask = given["visual_pos_masks"]
        return given["inputs_embeds"], given.get("attention_mask"), given.get("position_ids")

    def _shard_per_row(self, kwargs: dict[str, Any], inputs: Tensor) -> dict[str, Any]:
        """A later stage's per-row inputs of a whole batch under context parallelism, for its hidden states (this
        rank's shard, see the module doc): the positions' shard (the text positions when the model counts them), no
        attention mask (as for a text model under context parallelism)."""
        positions = kwargs.get("position_ids")
        if positions is None:
            seq = inputs.shape[1] * self.context.mesh.size()
            positions = torch.arange(seq, device=inputs.device).expand(inputs.shape[0], seq)
        return {"position_ids": self.context.cut(positions, -1), "attention_mask": None}

    def _unpack(self, inputs: Tensor) -> Tensor:
        """A later stage's hidden states, its received deepstack features kept (the batch's images have some)."""
        if not self.carried_in:
            return inputs
        hidden, *features = inputs.chunk(1 + self.carried_in, dim=-1)
        if self._batch.get("images"):
            self._features = {self._layers.start + k: feature for k, feature in enumerate(features)}
        return hidden.contiguous()

    def after_layer(self, index: int, hidden: Tensor) -> Tensor:
        """``hidden`` after decoder layer ``index`` with the micro-batch's deepstack feature for that layer added, as
        the language model adds it (see the module doc); unchanged when there is none."""
        feature = self._features.get(index)
        if feature is None:
            return hidden
        if self._mask is not None:  # the first stage: the language model's own addition at the image tokens
            return self.language._deepstack_process(hidden, self._mask, feature)
        return hidden + feature  # the feature is zero outside the image tokens

    def pack(self, hidden: Tensor) -> Tensor:
        """What this stage sends on: ``hidden``, and the deepstack features of later stages' layers (zero where a row
        has no image token, or for a batch without images) concatenated along the last dimension."""
        features, mask = self._features, self._mask
        self._features, self._mask = {}, None
        if not self.carried_out:
            return hidden
        sent = [hidden]
        for index in range(self._layers.stop, self._layers.stop + self.carried_out):
            feature = features.get(index)
            if feature is None:
                feature = hidden.new_zeros(hidden.shape)
            elif mask is not None:  # the first stage's: one row per image token, placed at the image tokens
                feature = hidden.new_zeros(hidden.shape).index_put((mask,), feature.to(hidden.dtype))
            sent.append(feature.to(hidden.dtype))
        return torch.cat(sent, dim=-1)


def _image_table(config: Any, input_ids: Tensor, images: dict[str, Tensor]) -> list[tuple[int, int, int]]:
    """Each image's ``(row, first, end)``: its row and its entries of ``pixel_values`` (patches or one image).

    Raises:
        ValueError: when the images' tokens do not match the rows' image tokens.
    """
    token = getattr(config, "image_token_id", None)
    row_tokens = (input_ids == token).sum(1).tolist()
    grid, pixels = images.get("image_grid_thw"), images["pixel_values"]
    if grid is not None:
        merge = getattr(config.vision_config, "spatial_merge_size", 1)
        sizes = grid.prod(-1).tolist()
        tokens = [size // merge**2 for size in sizes]
    else:
        count, total = pixels.shape[0], sum(row_tokens)
        if count == 0 or total % count:
            raise ValueError(
                f"The batch holds {total} image tokens (id {token}) and {count} images in pixel_values, which do not"
                " split evenly: under pipeline parallelism each micro-batch takes its rows' images."
            )
        sizes, tokens = [1] * count, [total // count] * count
    table, row, used, start = [], 0, 0, 0
    for size, need in zip(sizes, tokens):
        while row < len(row_tokens) and used + need > row_tokens[row]:
            if used:
                raise ValueError(f"An image's {need} tokens cross the end of row {row} ({row_tokens[row]} tokens).")
            row += 1
        if row == len(row_tokens):
            raise ValueError(f"The batch's images need more image tokens than its rows hold ({sum(row_tokens)}).")
        table.append((row, start, start + size))
        used, start = used + need, start + size
        if used == row_tokens[row]:
            row, used = row + 1, 0
    if sum(tokens) != sum(row_tokens):
        raise ValueError(f"The batch's images fill {sum(tokens)} image tokens, its rows hold {sum(row_tokens)}.")
    return table


def _rows_images(images: dict[str, Tensor], table: list[tuple[int, int, int]], rows: list[int]) -> dict[str, Tensor]:
    """The images of ``rows`` (in their order), as the model takes them; nothing for rows without images."""
    mine = [index for row in rows for index, entry in enumerate(table) if entry[0] == row]
    if not mine:
        return {}
    pixels = images["pixel_values"]
    entries = torch.cat([torch.arange(table[i][1], table[i][2], device=pixels.device) for i in mine])
    out = {"pixel_values": pixels[entries]}
    if (grid := images.get("image_grid_thw")) is not None:
        out["image_grid_thw"] = grid[torch.tensor(mine, device=grid.device)]
    return out


def hand_batch_to_stages(
    preludes: list[ImageTextPrelude],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    extra: Mapping[str, Any],
) -> None:
    """Give every stage's prelude this batch's images and per-row inputs, positions computed on the whole rows.

    Args:
        preludes: This rank's stages' preludes.
        input_ids: ``[batch, seq]``.
        attention_mask: ``[batch, seq]`` or ``None``.
        position_ids: The batch's own, else computed here as the model's forward would.
        extra: The model call's other keyword arguments (images, ``token_type_ids``, ``mm_token_type_ids``, ...).

    Raises:
        ValueError: for videos, ``inputs_embeds``, or a tensor argument the multimodal forward does not take.
    """
    base = preludes[0].base
    accepted = set(inspect.signature(base.forward).parameters)
    if videos := sorted(key for key in _VIDEO_INPUTS if extra.get(key) is not None):
        raise ValueError(f"Under pipeline parallelism an image-text batch cannot hold videos yet ({videos}).")
    images = {key: extra[key] for key in IMAGE_INPUTS if extra.get(key) is not None}
    per_row = {
        key: value
        for key, value in extra.items()
        if isinstance(value, Tensor) and key not in IMAGE_INPUTS and key in accepted and key != "labels"
    }
    odd = sorted(key for key, value in per_row.items() if value.shape[:2] != input_ids.shape)
    if odd:
        raise ValueError(
            f"Under pipeline parallelism the image-text batch's {odd} must have one entry per token ([batch, seq]):"
            " each micro-batch takes its rows of them."
        )
    if position_ids is None:
        position_ids = _model_positions(base, input_ids, attention_mask, images, per_row)
    if position_ids is not None:
        position_ids = position_ids.expand(input_ids.shape[0], -1) if position_ids.ndim == 2 else position_ids
        per_row["position_ids"] = position_ids.transpose(0, 1) if position_ids.ndim == 3 else position_ids
    for prelude in preludes:
        prelude.set_batch(input_ids, per_row, images)


def _model_positions(
    base: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, images: dict, per_row: dict
) -> Tensor | None:
    """The positions the multimodal forward computes on the whole rows (``compute_3d_position_ids``: Qwen's
    multimodal RoPE), or ``None`` for a model whose language model counts them itself."""
    compute = getattr(base, "compute_3d_position_ids", None)
    if compute is None:
        return None
    given = {"input_ids": input_ids, "attention_mask": attention_mask, **images, **per_row}
    names = inspect.signature(compute).parameters
    kwargs = {name: given.get(name) for name in names if name not in ("self", "kwargs")}
    positions = compute(**kwargs)
    if positions is None:  # no images: its language model counts from 0, as here (a later stage, given hidden states
        # and no token ids, would compute them from an earlier batch's rope deltas)
        rows, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device).expand(rows, seq)
    return positions
