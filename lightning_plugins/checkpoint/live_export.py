"""Export a (possibly parallelized) model to a directory that plain `transformers` / `peft` load.

* A full model: an HF checkpoint directory (``AutoModelForCausalLM.from_pretrained(dir)``).
* A LoRA model: a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``;
  ``PeftModel.from_pretrained(base, dir)``), or with ``merge=True`` the adapters merged into the base
  weights, written as an HF checkpoint directory.

Every layout exports the same files: DTensors (TP, FSDP2) are gathered with ``full_tensor`` by the ranks
that share them, pipeline stages send their part to rank 0, and rank 0 writes. (Distributed save/resume
during training is DCP through the doors, see the strategies.)
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lightning_plugins.adapters.lora import PEFT_PREFIX, lora_layers
from lightning_plugins.parallel.hf_model import hf_model_of
from lightning_plugins.parallel.gather import collect_stages, full_on_leader, stage_leader
from lightning_plugins.parallel.save_pretrained import save_adapters, save_model

__all__ = ["export_hf"]


def export_hf(model: nn.Module, out_dir: str | Path, tokenizer: Any | None = None, *, merge: bool = False) -> Path:
    """Write ``model`` to ``out_dir``: an HF checkpoint directory, or for a LoRA model a peft adapter directory.

    Collective: every rank must call it. The directory is written under a temporary name and moved into
    place when complete, so a crash never leaves a half-written export at ``out_dir``.

    Args:
        model: A transformers model or a peft ``PeftModel`` (or the transformers model inside one),
            parallelized by :func:`lightning_plugins.parallelize` or not.
        out_dir: Destination directory; replaced if it exists.
        tokenizer: Optional tokenizer saved alongside.
        merge: For a LoRA model: write the base weights with the active adapters merged in
            (``W + scaling * B @ A``) as a plain HF checkpoint instead of the adapter.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ValueError: for ``merge=True`` on a model without LoRA adapters, with NF4 (QLoRA) base weights, or
            with adapters that cannot be merged into a linear weight (DoRA, embedding LoRA, modules_to_save).
    """
    hf = hf_model_of(model)
    adapted = any(True for _ in lora_layers(hf))
    if merge:
        _check_mergeable(hf, adapted)
    # Each pipeline stage's leader gets its stage's full tensors (the others get nothing) and turns them into
    # what is written while it has the stage's modules at hand; rank 0 then collects the stages.
    sharded = get_model_state_dict(hf)  # no communication: each rank's own shards, by parameter name
    if adapted and not merge:
        # peft picks each adapter's entries by visiting its layers (whatever requires_grad says: set_adapter
        # freezes the inactive ones); only those are gathered.
        picked = {name: _adapter_entries(hf, sharded, name) for name in hf.peft_config}
        state = collect_stages(hf, full_on_leader(hf, picked))
        _write_atomically(out_dir, lambda tmp: save_adapters(hf, state, tmp), tokenizer)
    else:
        state = full_on_leader(hf, sharded)
        if merge and state:
            state = _merge_adapters(hf, state)
        state = collect_stages(hf, state)
        _write_atomically(out_dir, lambda tmp: save_model(hf, state, tmp), tokenizer)
    return Path(out_dir)


def _write_atomically(out_dir: str | Path, write: Callable[[Path], None], tokenizer: Any | None) -> None:
    """Rank 0 writes into ``<out_dir>.partial`` and renames it to ``out_dir``; every rank waits for it."""
    out = Path(out_dir)
    distributed = dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        write(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        if out.exists():
            shutil.rmtree(out)
        os.replace(partial, out)
    if distributed:
        dist.barrier()


# ------------------------------------------------------------------------------------------------ gathering


# -------------------------------------------------------------------------------------------------- writing


def _adapter_entries(model: nn.Module, state: dict[str, Tensor], adapter: str) -> dict[str, Tensor]:
    """The entries of ``state`` that ``PeftModel.save_pretrained`` writes for ``adapter``, under its file's keys."""
    from peft.utils import get_peft_model_state_dict

    entries = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter, save_embedding_layers=False)
    return {PEFT_PREFIX + key: value for key, value in entries.items()}


# -------------------------------------------------------------------------------------------------- merging


def _check_mergeable(model: nn.Module, adapted: bool) -> None:
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils.other import AuxiliaryTrainingWrapper

    from lightning_plugins.parallel.quantized import is_nf4

    if not adapted:
        raise ValueError(
            f"export_hf(merge=True) merges LoRA adapters into the base weights, but {type(model).__name__} has no LoRA"
            " layer. Export it with merge=False."
        )
    if any(is_nf4(param) for param in model.parameters()):
        raise ValueError(
            "export_hf(merge=True): the base weights are NF4 (QLoRA); merging needs dense weights. Export the adapter"
            " (merge=False), then merge it into the dense base in one process:"
            " PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()."
        )
    for name, module in model.named_modules():
        plain_lora = _own_class(module) is LoraLinear and not module.lora_variant
        if isinstance(module, AuxiliaryTrainingWrapper) or (_is_lora(module) and not plain_lora):
            raise ValueError(
                f"export_hf(merge=True) merges plain LoRA on linear layers; {name} ({type(module).__name__}) is not."
                " Export the adapter (merge=False) and merge it with peft in one process:"
                " PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()."
            )


def _own_class(module: nn.Module) -> type:
    """The module's class, under the ``FSDP<class>`` that ``fully_shard`` puts in front of it (an adapted head is a
    unit of its own)."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls


def _is_lora(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


@torch.no_grad()
def _merge_adapters(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with each LoRA layer's active adapters merged into its base weight, under the plain names."""
    merged = dict(state)
    for name, layer in lora_layers(model):
        weight = merged.pop(f"{name}.base_layer.weight")
        update = torch.zeros_like(weight, dtype=torch.float32)
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                a, b = merged[f"{name}.lora_A.{adapter}.weight"], merged[f"{name}.lora_B.{adapter}.weight"]
                delta = (b.float() @ a.float()) * layer.scaling[adapter]
                update += delta.T if layer.fan_in_fan_out else delta
        merged[f"{name}.weight"] = (weight.float() + update).to(weight.dtype)
        for key in [k for k in merged if k.startswith(f"{name}.")]:
            rest = key.removeprefix(f"{name}.")
            if rest.startswith("base_layer."):
                merged[f"{name}.{rest.removeprefix('base_layer.')}"] = merged.pop(key)  # e.g. the bias
            elif rest.startswith("lora_"):
                del merged[key]
    return merged
