"""A full fine-tune's DPO reference: a frozen copy of the policy's starting weights, laid out exactly like the policy.

Under LoRA the reference is the policy's own base with the adapters disabled (no copy). A full fine-tune changes every
weight, so DPO needs the starting model kept apart: :func:`frozen_reference` builds it on the meta device from the
policy's config, applies the policy's own plan to it (its mesh, options and memory levers: FSDP2 shards, TP/SP/loss
parallel, CP, EP, as the policy has them) and fills each rank's slices from the starting checkpoint
(:func:`~lightning_plugins.checkpoint.load.load_sharded_safetensors`): no rank ever holds the whole model, and each
holds the copy's shard of the parameters only (no gradients, no optimizer state). It runs in eval mode (TRL prepares
its reference model for evaluation: dropout off) and under ``no_grad``.

FSDP2 leaves the root's parameters (embeddings, final norm, head) gathered after a forward, expecting the backward to
use them; a reference never runs backward, so :func:`reshard` frees them after each reference forward (otherwise the
whole embedding and head stayed on every rank for the run).

:func:`precompute_reference_logps` takes the other road: one pass of the reference over the data before training,
its per-row log-probabilities handed back to the objective with each batch (``batch["ref_logps"]``), so that no
reference is held or run while training (TRL's ``precompute_ref_log_probs``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_plugins.checkpoint.load import checkpoint_dir_of, load_sharded_safetensors
from lightning_plugins.parallel.context.wiring import wrapped_attention
from lightning_plugins.parallel.fsdp import reshard_gathered as reshard
from lightning_plugins.parallel.hf_model import hf_model_of
from lightning_plugins.parallel.mesh import mesh_of

__all__ = ["frozen_reference", "precompute_reference_logps", "reshard"]


def frozen_reference(policy: nn.Module, checkpoint_dir: str | Path | None = None) -> nn.Module:
    """A frozen copy of ``policy`` as it starts: built on meta, parallelized like ``policy``, loaded sharded.

    Args:
        policy: The transformers causal LM being trained (after the engine's ``parallelize``, or one process's).
        checkpoint_dir: The HF checkpoint the policy started from (default: its config's ``name_or_path``, which is
            the recipe's ``model.path`` for a model built by the recipe, also when the run resumes).

    Raises:
        LayoutError: when no local checkpoint directory is known, naming the fix.
    """
    from transformers import AutoModelForCausalLM

    from lightning_plugins.parallel.api import SETTINGS_ATTR, parallelize

    policy = hf_model_of(policy)
    source = checkpoint_dir_of(policy, checkpoint_dir, "the DPO reference (objective.reference: model)")
    first = next(policy.parameters())
    config = copy.deepcopy(policy.config)
    config.use_cache = False
    # Under CP the policy's attention is the context-parallel wrapper; the copy starts from what it wraps, and
    # parallelize wraps it again.
    attention = wrapped_attention(policy) or policy.config._attn_implementation
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config, dtype=first.dtype, attn_implementation=attention)
    mesh = mesh_of(policy)
    if mesh is not None:
        options, memory = getattr(policy, SETTINGS_ATTR, (None, None))
        parallelize(reference, mesh, options, memory)  # the policy's mesh, options and memory levers
    device = None if mesh is not None else first.device
    load_sharded_safetensors(reference, source, device)
    reference.requires_grad_(False)
    return reference.eval()


def precompute_reference_logps(objective: Any, model: nn.Module, batches: Iterable[dict[str, Tensor]]) -> list[Tensor]:
    """The reference's log-probabilities of every row of ``batches`` (one no-grad pass; this rank's batches, as the
    loader hands them over), one tensor per batch: what ``batch["ref_logps"]`` carries back to
    :class:`~lightning_plugins.preference.objective.PreferenceObjective` while training. Call it before the first
    optimizer step: the reference is the base (adapters disabled) or the frozen copy the objective holds."""
    return [objective.reference_logps(model, batch).logps.detach() for batch in batches]
