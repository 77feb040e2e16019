"""``lightning-plugins export CHECKPOINT OUT_DIR``: a training checkpoint (DCP) to an HF or peft directory, streaming.

A checkpoint written by either door (``output_dir/checkpoints/step=N.ckpt``, under any layout) is read in
one process, without a process group, tensor by tensor (a DCP load without a process group of a few entries at a
time, which reassembles each from the shards the ranks wrote; every pickle read by
:mod:`~lightning_plugins.checkpoint.safe_read`), and written tensor by tensor
into safetensors files whose headers are known up front (:mod:`lightning_plugins.checkpoint.safetensors_io`). The
peak host memory is therefore a small multiple of the largest tensor, whatever the model size.

What is written:

* a full fine-tune: an HF checkpoint directory as ``save_pretrained`` writes it (``model.safetensors``, or
  ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json``; ``config.json``,
  ``generation_config.json`` and the tokenizer), under the plain HF parameter names whatever the layout or
  door (``lm_head.weight`` left out when the config ties it to the embeddings, as transformers does);
* a LoRA run: a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors`` and the
  tokenizer; other adapters than ``default`` in sub-directories of their name), or with ``merge=True`` the
  adapters merged into the base weights (read, streaming too, from the original model directory) as an
  HF checkpoint directory.

The doors store what this needs next to the weights (:mod:`lightning_plugins.checkpoint.export_info`: the HF config, the
tokenizer, the adapter configs, the original model's path, under ``<checkpoint>/export/``), so the checkpoint
alone suffices; ``model=`` overrides the model directory (config, tokenizer and, for ``merge``, the base).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_plugins.adapters.lora import PEFT_PREFIX
from lightning_plugins.errors import CheckpointError
from lightning_plugins.checkpoint.export_info import (
    EXPORT_DIR,
    ExportError,
    adapter_configs,
    export_config,
    read_export_info,
    write_config,
    write_tokenizer,
    save_export_info,
)
from lightning_plugins.checkpoint.hub_names import in_hub_layout
from lightning_plugins.checkpoint.integrity import say_unverified, verify_checkpoint
from lightning_plugins.checkpoint.safe_read import SafeReader, load_dcp
from lightning_plugins.checkpoint.safetensors_io import SafetensorsDirectory, TensorSpec, nbytes, write_streaming

__all__ = ["EXPORT_DIR", "ExportError", "export_checkpoint", "save_export_info"]

_DEFAULT_SHARD = 5 * 2**30


# ------------------------------------------------------------------------------------------------ export


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    merge: bool = False,
    model: str | Path | None = None,
    force: bool = False,
    max_shard_size: int = _DEFAULT_SHARD,
) -> Path:
    """Turn a distributed (DCP) checkpoint into an HF directory, or for a LoRA run a peft adapter directory.

    Runs in one process, no process group needed; streams tensor by tensor. The result is written into
    ``<out_dir>.partial`` and renamed to ``out_dir`` when complete.

    Args:
        checkpoint: A complete checkpoint directory (``.../checkpoints/step=N.ckpt``) written by either door.
        out_dir: Where to write; must not exist or be empty unless ``force``.
        merge: For a LoRA checkpoint: merge the adapters into the base weights (read from the original model
            directory) and write an HF checkpoint directory instead of the adapter.
        model: The original HF model directory: config and tokenizer (and the base for ``merge``) come from
            it instead of what the checkpoint recorded.
        force: Replace an existing non-empty ``out_dir``.
        max_shard_size: Bytes per safetensors file at most (a larger single tensor gets a file of its own).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        ExportError: for an incomplete checkpoint, an existing output, a model that does not match, or a LoRA
            setting that cannot be merged.
    """
    ckpt = Path(checkpoint)
    _check_complete(ckpt)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"{out} exists and is not empty: choose another directory, or pass --force to replace it.")
    info = read_export_info(ckpt)
    source = str(model) if model is not None else info.get("model_path") or None
    config = export_config(ckpt, model, source)
    reader = SafeReader(ckpt)  # .metadata parsed once (restricted) for the many small loads
    tensors = {
        key: md
        for key, md in reader.read_metadata().state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    meta = _meta_model(config)
    names = _hf_names(meta)
    prefix = info.get("state_prefix") or _infer_prefix(tensors, names, ckpt)
    adapted = sorted({key for key in tensors if key.startswith(prefix) and ".lora_" in key})
    if merge and not adapted:
        raise ExportError(f"--merge merges LoRA adapters, but {ckpt} holds no LoRA weight. Export without --merge.")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        if adapted and not merge:
            _write_adapters(reader, tensors, prefix, adapted, info, ckpt, partial)
        else:
            if adapted:
                specs, produce = _merged(reader, tensors, prefix, names, info, ckpt, source)
            else:
                specs, produce = _full(reader, tensors, prefix, names, ckpt)
            _write_shards(*in_hub_layout(meta, specs, produce), partial, max_shard_size)
            write_config(ckpt, model, config, partial)
        write_tokenizer(ckpt, model, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _publish(partial, out)
    return out


def _check_complete(ckpt: Path) -> None:
    """``ckpt`` is a finished save whose files match their checksums (a checkpoint without checksums is said so)."""
    if not (ckpt / ".metadata").is_file():
        hint = (
            " (an interrupted save leaves only `*.partial`)" if ckpt.is_dir() or ckpt.name.endswith(".partial") else ""
        )
        raise ExportError(
            f"{ckpt} is not a complete distributed checkpoint: it has no .metadata{hint}. Pass a"
            " `checkpoints/step=N.ckpt` directory written by a finished save."
        )
    try:  # its files against its checksums, before anything is read
        if not verify_checkpoint(ckpt):
            say_unverified(ckpt, lambda line: print(line, file=sys.stderr))
    except CheckpointError as error:
        raise ExportError(str(error)) from None


def _publish(partial: Path, out: Path) -> None:
    """Move the complete ``partial`` directory to ``out``, replacing what was there only once it is in place."""
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, out)


def _load(reader: SafeReader, tensors: dict[str, TensorStorageMetadata], keys: list[str]) -> dict[str, Tensor]:
    """The full tensors ``keys`` of the checkpoint (reassembled from every rank's shards) in this process."""
    state = {key: torch.empty(tensors[key].size, dtype=tensors[key].properties.dtype) for key in keys}
    with warnings.catch_warnings():  # one process on purpose: no process group is needed to read a checkpoint
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load_dcp(state, reader, no_dist=True)
    return state


def _stream(
    reader: SafeReader, tensors: dict[str, TensorStorageMetadata], keys: dict[str, str]
) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for ``keys`` (name -> checkpoint key), loading a few at a time: never more than the
    largest tensor's bytes per load (small ones such as norms are read together)."""
    budget = max((_spec(tensors[key])[0] for key in keys.values()), default=0)
    group: list[tuple[str, str]] = []
    size = 0

    def flush() -> Iterator[tuple[str, Tensor]]:
        loaded = _load(reader, tensors, [key for _, key in group])
        for name, key in group:
            yield name, loaded.pop(key)

    for name, key in keys.items():
        nb = _spec(tensors[key])[0]
        if group and size + nb > budget:
            yield from flush()
            group, size = [], 0
        group.append((name, key))
        size += nb
    if group:
        yield from flush()


def _spec(md: TensorStorageMetadata) -> tuple[int, TensorSpec]:
    spec = (tuple(md.size), md.properties.dtype)
    return nbytes(spec), spec


# -------------------------------------------------------------------------------------------- full / merged


def _full(reader: SafeReader, tensors: dict, prefix: str, names: dict[str, TensorSpec], ckpt: Path) -> tuple[dict, Any]:
    keys = {name: _key_of(tensors, prefix, name, ckpt) for name in names}
    specs = {}
    for name, key in keys.items():
        spec = _spec(tensors[key])[1]
        if spec[0] != names[name][0]:
            raise ExportError(
                f"{ckpt}: {key} has shape {spec[0]} but the model config gives {name} the shape {names[name][0]}:"
                " the checkpoint is of another model. Pass its own model directory with --model."
            )
        specs[name] = spec
    return specs, lambda chosen: _stream(reader, tensors, {name: keys[name] for name in chosen})


def _merged(
    reader: SafeReader,
    tensors: dict,
    prefix: str,
    names: dict[str, TensorSpec],
    info: dict,
    ckpt: Path,
    source: str | None,
) -> tuple[dict, Any]:
    """Specs and a producer of the base weights (from ``source``) with the active adapters merged in."""
    from peft.utils.other import get_pattern_key

    if source is None or not Path(source).is_dir():
        raise ExportError(
            f"--merge reads the base weights from the original model directory, and {ckpt} records"
            f" {source!r}, not a local directory. Pass it with --model DIR."
        )
    base = SafetensorsDirectory(source)
    configs = adapter_configs(ckpt, info)
    active = info.get("active_adapters") or (["default"] if "default" in configs else sorted(configs))
    deltas: dict[str, list[tuple[str, str, float, bool]]] = {}  # weight name -> (A key, B key, scaling, fan_in_fan_out)
    for adapter in active:
        config = configs[adapter]
        if getattr(config, "use_dora", False) or getattr(config, "modules_to_save", None):
            raise ExportError(
                f"--merge merges plain LoRA; adapter {adapter!r} of {ckpt} uses DoRA or modules_to_save. Export the"
                " adapter (without --merge) and merge it with peft: PeftModel.from_pretrained(base, dir).merge_and_unload()."
            )
        for key in tensors:
            tail = key[len(prefix) :] if key.startswith(prefix) else None
            if tail is None or not tail.endswith(f".lora_A.{adapter}.weight"):
                continue
            module = tail.removesuffix(f".lora_A.{adapter}.weight")
            rank = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
            alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
            scaling = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
            b_key = f"{prefix}{module}.lora_B.{adapter}.weight"
            deltas.setdefault(f"{module}.weight", []).append((key, b_key, scaling, bool(config.fan_in_fan_out)))
    if any(".lora_embedding_" in key or ".lora_magnitude_vector" in key for key in tensors):
        raise ExportError(
            f"--merge merges LoRA on linear layers; {ckpt} has embedding or DoRA adapters. Export the adapter."
        )
    specs = {}
    for name in names:
        if name not in base:
            raise ExportError(f"{source} has no weight {name!r}: it is not the base model of {ckpt}.")
        trained = tensors.get(f"{prefix}{_lora_base(name)}") or tensors.get(f"{prefix}{name}")
        dtype = trained.properties.dtype if trained is not None and trained.properties.dtype.is_floating_point else None
        specs[name] = (names[name][0], dtype or base.dtype(name))
    unknown = sorted(set(deltas) - set(names))
    if unknown:
        raise ExportError(f"{ckpt}: adapters on {unknown[:3]}, which the model config does not have.")

    def produce(chosen: list[str]) -> Iterator[tuple[str, Tensor]]:
        for name in chosen:
            weight = base.read(name)
            if tuple(weight.shape) != specs[name][0]:
                raise ExportError(f"{source}: {name} has shape {tuple(weight.shape)}, the config {specs[name][0]}.")
            if name in deltas:
                update = torch.zeros(weight.shape, dtype=torch.float32)
                for a_key, b_key, scaling, transposed in deltas[name]:
                    ab = _load(reader, tensors, [a_key, b_key])
                    delta = (ab[b_key].float() @ ab[a_key].float()) * scaling
                    update += delta.T if transposed else delta
                weight = weight.float() + update
            yield name, weight.to(specs[name][1])

    return specs, produce


def _lora_base(name: str) -> str:
    """``x.q_proj.weight`` -> ``x.q_proj.base_layer.weight`` (where peft keeps a wrapped layer's weight)."""
    module, _, leaf = name.rpartition(".")
    return f"{module}.base_layer.{leaf}"


def _key_of(tensors: dict, prefix: str, name: str, ckpt: Path) -> str:
    for key in (f"{prefix}{name}", f"{prefix}{_lora_base(name)}"):
        if key in tensors:
            return key
    raise ExportError(
        f"{ckpt} has no weight for {name} (looked for {prefix}{name}): the checkpoint is of another model or"
        " was saved under other names. Pass its own model directory with --model."
    )


def _write_shards(specs: dict[str, TensorSpec], produce: Any, directory: Path, max_shard_size: int) -> None:
    """``save_pretrained``'s layout: one ``model.safetensors``, or numbered shards and their index."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        nb = nbytes(spec)
        if shards[-1] and size + nb > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nb
    count = len(shards)
    files = (
        ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    for file, chosen in zip(files, shards):
        write_streaming(directory / file, {name: specs[name] for name in chosen}, produce(chosen))
    if count > 1:
        index = {
            "metadata": {"total_size": sum(nbytes(spec) for spec in specs.values())},
            "weight_map": {name: file for file, chosen in zip(files, shards) for name in chosen},
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# --------------------------------------------------------------------------------------------------- adapters


def _write_adapters(
    reader: SafeReader, tensors: dict, prefix: str, adapted: list[str], info: dict, ckpt: Path, directory: Path
) -> None:
    """peft's layout: ``default`` at the top, any other adapter in a sub-directory of its name."""
    configs = adapter_configs(ckpt, info)
    for adapter, config in configs.items():
        keys = {}
        for key in adapted:
            parts = key[len(prefix) :].split(".")
            if adapter in parts:
                parts.remove(adapter)  # peft's file keys carry no adapter name
                keys[PEFT_PREFIX + ".".join(parts)] = key
        extra = sorted(
            key for key in tensors if key.startswith(prefix) and f".{adapter}." in key and ".lora_" not in key
        )
        if extra:
            raise ExportError(
                f"{ckpt}: adapter {adapter!r} trains {extra[0]} besides its LoRA weights (modules_to_save?); the"
                " streaming export writes LoRA weights only. Export from the model in memory (export_hf)."
            )
        if not keys:
            raise ExportError(f"{ckpt} has no weight of adapter {adapter!r} (its keys start with {prefix!r}).")
        target = directory if adapter == "default" else directory / adapter
        target.mkdir(parents=True, exist_ok=True)
        specs = {name: _spec(tensors[key])[1] for name, key in keys.items()}
        write_streaming(target / "adapter_model.safetensors", specs, _stream(reader, tensors, keys))
        config.save_pretrained(str(target))


# ------------------------------------------------------------------------------------- config, names, tokenizer


def _meta_model(config: Any) -> nn.Module:
    """``config``'s causal LM on the meta device: its names and shapes, no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _hf_names(meta: nn.Module) -> dict[str, TensorSpec]:
    """The model's names, shapes and dtypes (tied copies left out): what ``save_pretrained`` writes, before
    transformers reverts its load-time conversions (:func:`~lightning_plugins.checkpoint.hub_names.in_hub_layout`)."""
    seen: set[int] = set()
    names = {}
    for name, tensor in meta.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # e.g. lm_head.weight tied to the embeddings: transformers re-ties it on load
            continue
        seen.add(id(tensor))
        names[name] = (tuple(tensor.shape), tensor.dtype)
    return names


def _infer_prefix(tensors: dict, names: dict[str, TensorSpec], ckpt: Path) -> str:
    """The key prefix under which the checkpoint holds the model's weights (for checkpoints without export.json)."""
    counts: dict[str, int] = {}
    for key in tensors:
        if key.startswith(("optimizer", "grads")):
            continue
        for name in names:
            for form in (name, _lora_base(name)):
                if key.endswith(form) and (len(key) == len(form) or key[-len(form) - 1] == "."):
                    counts[key[: len(key) - len(form)]] = counts.get(key[: len(key) - len(form)], 0) + 1
    if not counts:
        raise ExportError(
            f"{ckpt} holds none of the model's weights (e.g. {next(iter(names))}): pass the right --model."
        )
    return max(counts, key=counts.__getitem__)


