"""A recipe whose data holds images: the whole image-text model (vision tower, projector, language model) and its
processor, instead of the text decoder alone; what of it trains (``vision:``) checked with the file's name.

Whether a recipe is an image-text one is decided by its data (:func:`~lightning_plugins.data.image_dataset.
is_image_text_data`: ``data.format: image_text``, or records with ``images``), so one model directory serves text
fine-tuning of its decoder and image-text fine-tuning of the whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_plugins.errors import OptionsError, RecipeError

if TYPE_CHECKING:
    from lightning_plugins.recipe.schema import Recipe


def check_image_text_recipe(recipe: Recipe, path: Path) -> None:
    """The ``vision:`` section and the data against each other, the model (a local one's whole config) and the
    layout."""
    from lightning_plugins.checkpoint.text_tower import checkpoint_config
    from lightning_plugins.data.image_dataset import is_image_text_data
    from lightning_plugins.parallel.image_text import check_image_text_layout

    vision = recipe.vision
    images = is_image_text_data(recipe.data)
    if not images:
        if vision.train_tower is not None or vision.train_projector is not None:
            raise RecipeError(
                f"{path}: vision: the data ({recipe.data.train}) holds no images, so only the text decoder trains."
                " Remove the vision section, or give image-text records (data.format: image_text)."
            )
        return
    try:
        vision.trains(lora=recipe.lora is not None)
    except OptionsError as err:
        raise RecipeError(f"{path}: {err}") from None
    config = checkpoint_config(recipe.model.path) if Path(recipe.model.path).is_dir() else None
    if recipe.data.packing:
        from lightning_plugins.data.image_packing import image_packing_refusal

        layout = recipe.layout
        why = image_packing_refusal(getattr(config, "model_type", None), layout.cp_size, layout.pp_size,
                                    recipe.model.attn_implementation)  # fmt: skip
        if why is not None:
            raise RecipeError(f"{path}: data.packing: {why} Set data.packing: false.")
    if config is not None and getattr(config, "vision_config", None) is None:
        raise RecipeError(
            f"{path}: the data ({recipe.data.train}) holds images but model.path={recipe.model.path!r} is a"
            f" {getattr(config, 'model_type', '?')} model without a vision tower. Point model.path at an image-text"
            " model (AutoModelForImageTextToText), or give text records."
        )
    try:
        check_image_text_layout(recipe.layout, config)
    except ValueError as err:
        raise RecipeError(f"{path}: layout: {err}") from None


def build_image_text_model(recipe: Recipe, path: str, kwargs: dict[str, Any], on_meta: bool) -> tuple[Any, Any]:
    """The processor and the image-text model (on the meta device unless ``on_meta=False``), its parts frozen or
    trained as ``vision:`` says, LoRA applied when asked."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from lightning_plugins.adapters.vision import freeze_vision

    remote = {"trust_remote_code": recipe.model.trust_remote_code}
    processor = AutoProcessor.from_pretrained(path, **remote)
    tokenizer = getattr(processor, "tokenizer", processor)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(path, **remote)
    if on_meta:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config, **kwargs, **remote)
    else:
        model = AutoModelForImageTextToText.from_pretrained(path, config=config, **kwargs, **remote)
    model.train()
    # Training: no KV cache. The language model reads its own text config's, which is on by default: it would build a
    # cache of every layer's keys and values in each forward (and the planner plans without one).
    model.config.use_cache = model.config.get_text_config().use_cache = False
    if recipe.data.packing:  # samples packed into rows (lightning_plugins.data.image_packing)
        from lightning_plugins.data.image_packing import prepare_model_for_image_packing

        prepare_model_for_image_packing(model, device=recipe.hardware.device_type())
    if recipe.lora is None:
        freeze_vision(model, recipe.vision)
    else:
        from lightning_plugins.adapters.lora import apply_lora

        torch.manual_seed(recipe.train.seed)  # identical adapters on every rank
        model = apply_lora(model, recipe.lora)
    return model, processor


def image_text_collate(recipe: Recipe, processor: Any) -> Any:
    """The collator of the recipe's image-text batches: padded samples, or with ``data.packing`` the drawn samples
    packed into rows (:mod:`lightning_plugins.data.image_packing`, which reads the model's config)."""
    from lightning_plugins.data.image_dataset import image_text_collator

    if not recipe.data.packing:
        return image_text_collator(processor)
    from transformers import AutoConfig

    from lightning_plugins.checkpoint.snapshot import local_checkpoint
    from lightning_plugins.data.image_packing import image_packing_collator

    remote = {"trust_remote_code": recipe.model.trust_remote_code}
    config = AutoConfig.from_pretrained(local_checkpoint(recipe.model.path, **remote), **remote)
    return image_packing_collator(processor, config, recipe.data.max_seq_len)
