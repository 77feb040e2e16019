"""The model a dry run lays out, on the meta device, before LoRA and the layout: the recipe's causal LM, or for an
image-text recipe the whole image-text model (:mod:`lightning_plugins.planner.image_text`)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_plugins.parallel.dtypes import DTYPES
from lightning_plugins.planner.image_text import image_text_model

if TYPE_CHECKING:
    from lightning_plugins.planner.workload import Workload


def meta_model(workload: Workload) -> nn.Module:
    """``workload``'s model at real size on the meta device, in the weights' dtype (not yet in training mode)."""
    if workload.images is not None:  # an image-text recipe: the whole model, its tower frozen or trained (vision:)
        return image_text_model(workload)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        # A copy: from_config writes the build dtype into the config it is given, which is the checkpoint's (its dtype
        # is what loading reads, host_memory.checkpoint_dtype).
        config = copy.deepcopy(workload.config)
        return AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[workload.dtype], attn_implementation=dry_run_attention(workload.attn_implementation)
        )


def dry_run_attention(implementation: str) -> str:
    """The attention the dry run measures for ``implementation``: flash attention 2/3 (packed rows' variable-length
    kernel included) needs CUDA and flash-attn, so the fake step runs sdpa, whose CPU kernel is a flash kernel too (no
    ``seq x seq`` scores; the dry run's rows carry no mask). The step time charges the flash kernel either way
    (:mod:`~lightning_plugins.planner.attention_kernels`)."""
    from lightning_plugins.data.packing import VARLEN_ATTENTION

    return "sdpa" if implementation in VARLEN_ATTENTION else implementation
