"""The text decoder of a multimodal checkpoint, trained as a causal LM of its own (Gemma 3 12B / 27B).

``google/gemma-3-27b-pt`` is an image-text checkpoint: its ``config.json`` is a ``Gemma3Config`` with a
``text_config`` (the decoder) and a ``vision_config`` (SigLIP), and ``AutoModelForCausalLM`` maps it to
``Gemma3ForConditionalGeneration`` (vision tower, projector and language model). Text fine-tuning wants the
decoder alone: :func:`text_config` is the config to build (``Gemma3ForCausalLM`` from the ``text_config``), and
:func:`tower_sources` names where each of its tensors is in the checkpoint. The multimodal model holds the
decoder as ``model.language_model`` (transformers >= 4.52) and the hub's files (and what transformers 5
``save_pretrained`` writes) as ``language_model.model.*``; the names are asked of the multimodal model itself
(built on the meta device) and of transformers' own conversion mapping (:func:`.hub_names.hub_source`), so either
spelling loads. The vision tower's tensors are never read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_plugins.checkpoint.hub_names import StackedExperts, hub_source

__all__ = ["checkpoint_config", "is_multimodal", "text_config", "tower_sources"]


def is_multimodal(config: Any) -> bool:
    """Whether ``config`` describes a model with a vision tower around a text decoder (a ``text_config``)."""
    if getattr(config, "vision_config", None) is None or not hasattr(config, "get_text_config"):
        return False
    return config.get_text_config(decoder=True) is not config


def text_config(config: Any) -> Any:
    """The config of the causal LM to train: a multimodal config's text decoder, any other config itself.

    The decoder's config keeps the checkpoint's ``name_or_path`` (so the meta-device loaders find the weights).
    """
    if not is_multimodal(config):
        return config
    text = config.get_text_config(decoder=True)
    text._name_or_path = config._name_or_path
    if isinstance(getattr(config, "tie_word_embeddings", None), bool):  # the whole model ties (or unties) its head
        text.tie_word_embeddings = config.tie_word_embeddings  # (Qwen3-VL's text config says true, its model unties)
    return text


def checkpoint_config(checkpoint_dir: str | Path) -> Any | None:
    """The transformers config of the checkpoint in ``checkpoint_dir``, or ``None`` when it has no config.json."""
    if not (Path(checkpoint_dir) / "config.json").is_file():
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(checkpoint_dir))


def tower_sources(
    model: nn.Module, whole: Any, shapes: dict[str, torch.Size], index: dict[str, Path]
) -> dict[str, str | StackedExperts]:
    """Where each tensor of the text-only ``model`` is in a checkpoint of the multimodal model ``whole`` describes.

    Args:
        model: The text decoder (e.g. ``Gemma3ForCausalLM``), whose base model is ``model.<base_model_prefix>``.
        whole: The checkpoint's (multimodal) config.
        shapes: The text model's tensor names -> global shapes.
        index: The checkpoint's tensor names -> file.

    Returns:
        Text model name -> the checkpoint name(s) of the same tensor in the multimodal model.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        multimodal = AutoModelForCausalLM.from_config(whole)
    decoder = multimodal.get_decoder()
    prefix = next(name for name, module in multimodal.named_modules() if module is decoder)
    base = getattr(model, "base_model_prefix", "model")

    def in_multimodal(name: str) -> str:
        head, _, rest = name.partition(".")
        return f"{prefix}.{rest}" if head == base else name

    sources: dict[str, str | StackedExperts] = {}
    for name, shape in shapes.items():
        ours = in_multimodal(name)
        sources[name] = ours if ours in index else hub_source(multimodal, ours, shape)
    return sources
