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

import copy
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lightning_plugins.adapters.lora import hf_model_of, lora_layers

__all__ = ["export_hf"]

#: peft's key prefix for the transformers model inside a ``PeftModel`` (``base_model.model.<name>``).
_PEFT_PREFIX = "base_model.model."


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
        state = _collect_stages(hf, _full_on_leader(hf, picked))
        _write_atomically(out_dir, lambda tmp: _save_adapters(hf, state, tmp), tokenizer)
    else:
        state = _full_on_leader(hf, sharded)
        if merge and state:
            state = _merge_adapters(hf, state)
        state = _collect_stages(hf, state)
        _write_atomically(out_dir, lambda tmp: _save_model(hf, state, tmp), tokenizer)
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


def _mesh(model: nn.Module) -> Any:
    from lightning_plugins.parallel import mesh_of

    return mesh_of(model)


def _stage_leader(model: nn.Module) -> int:
    """The global rank that collects this pipeline stage's full tensors (its first rank; rank 0 without PP)."""
    mesh = _mesh(model)
    if mesh is None:
        return 0
    coordinate = mesh.get_coordinate()
    return int(mesh.mesh[(coordinate[0], *[0] * (mesh.ndim - 1))])


def _full_on_leader(model: nn.Module, sharded: dict[str, Any]) -> dict[str, Any]:
    """The full (unsharded) CPU tensors of a (nested) state dict on the stage leader; ``{}`` elsewhere.

    Every rank gathers each DTensor with the ranks that share it (``full_tensor``); only the leader keeps it.
    """
    # DTensor logs a warning for every TP x FSDP2 weight it gathers in two steps; for an export that is fine.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        # torch's own full-state-dict gatherer (what get_model_state_dict uses), told which rank keeps the result.
        leader = (_stage_leader(model),) if dist.is_initialized() else ()
        return _gather_state_dict(sharded, cpu_offload=True, ranks_only=leader)
    finally:
        redistribute_log.setLevel(level)


def _collect_stages(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 receives every pipeline stage leader's part; without pipeline parallelism, nothing moves.

    Parts are merged key by key (one level down for per-adapter dictionaries).
    """
    mesh = _mesh(model)
    if mesh is None or mesh["pp"].size() == 1:
        return state
    if dist.get_rank() != _stage_leader(model):
        return {}
    # The leaders are the pipeline group of rank 0 (every other coordinate 0).
    parts: list[Any] | None = [None] * mesh["pp"].size() if dist.get_rank() == 0 else None
    dist.gather_object(state, parts, dst=0, group=mesh["pp"].get_group())
    merged: dict[str, Any] = {}
    for part in parts or []:
        for key, value in part.items():
            if isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    return merged


# -------------------------------------------------------------------------------------------------- writing


def _save_model(model: nn.Module, state: dict[str, Tensor], directory: str | Path, **options: Any) -> None:
    """transformers' own ``save_pretrained`` of ``model`` with the full ``state`` (and the caller's ``options``)."""
    # The class's method: `parallelize` replaced the instance's by the collective one (lightning_plugins.checkpoint.save_pretrained).
    type(model).save_pretrained(model, directory, state_dict=state, **options)
    # transformers records the class it saves from; a pipelined model's class is our subclass of it.
    hf_class = next(cls for cls in type(model).__mro__ if cls.__module__.startswith("transformers."))
    if model.config.architectures != [hf_class.__name__]:
        model.config.architectures = [hf_class.__name__]
        model.config.save_pretrained(directory)


def _adapter_entries(model: nn.Module, state: dict[str, Tensor], adapter: str) -> dict[str, Tensor]:
    """The entries of ``state`` that ``PeftModel.save_pretrained`` writes for ``adapter``, under its file's keys."""
    from peft.utils import get_peft_model_state_dict

    entries = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter, save_embedding_layers=False)
    return {_PEFT_PREFIX + key: value for key, value in entries.items()}


def _save_adapters(
    model: nn.Module, weights: dict[str, dict[str, Tensor]], directory: Path, *, safe_serialization: bool = True
) -> None:
    """peft's adapter layout for each adapter in ``weights``: ``default`` at the top, any other adapter in a
    sub-directory of its name (``safe_serialization=False``: ``adapter_model.bin``, as peft writes it)."""
    from safetensors.torch import save_file

    for name in weights:
        config = model.peft_config[name]
        target = directory if name == "default" else directory / name
        target.mkdir(parents=True, exist_ok=True)
        tensors = {key: value.contiguous() for key, value in weights[name].items()}
        if safe_serialization:
            save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
        else:
            torch.save(tensors, target / "adapter_model.bin")
        saved = copy.deepcopy(config)
        saved.inference_mode = True
        saved.save_pretrained(str(target))


# -------------------------------------------------------------------------------------------------- merging


def _check_mergeable(model: nn.Module, adapted: bool) -> None:
    from peft.tuners.lora import Linear as LoraLinear
    from peft.utils.other import AuxiliaryTrainingWrapper

    from lightning_plugins.adapters.qlora import is_nf4

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
        plain_lora = type(module) is LoraLinear and not module.lora_variant
        if isinstance(module, AuxiliaryTrainingWrapper) or (_is_lora(module) and not plain_lora):
            raise ValueError(
                f"export_hf(merge=True) merges plain LoRA on linear layers; {name} ({type(module).__name__}) is not."
                " Export the adapter (merge=False) and merge it with peft in one process:"
                " PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()."
            )


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
