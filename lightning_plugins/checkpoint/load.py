"""Meta-device models and sharded loading: each rank reads only its slices of the safetensors files.

No rank ever materialises the full model: the model is built on the meta device, parallelized (its
parameters become DTensors that know their global shape and placements), given empty local storage,
and each local shard is filled from ``safe_open(...).get_slice(name)[rows, cols]``. A checkpoint in the hub's
layout (what transformers 5 ``save_pretrained`` writes: a mixture-of-experts layer's experts as per-expert 2-D
tensors, which transformers fuses into 3-D ones at load time) is read through :mod:`.hub_names`: a rank reads only
the experts (and rows) it holds; MXFP4 experts (gpt-oss on the hub) are read dequantized through :mod:`.mxfp4`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_plugins.checkpoint.hub_names import StackedExperts, hub_source
from lightning_plugins.checkpoint.mxfp4 import Mxfp4Experts, forget_mxfp4, mxfp4_source
from lightning_plugins.checkpoint.text_tower import checkpoint_config, is_multimodal, text_config, tower_sources
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel import mesh_of, parallelize


def is_on_meta(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` lives on the meta device (has no storage yet)."""
    return any(p.is_meta for p in model.parameters())


def checkpoint_index(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name in an HF safetensors checkpoint directory to the file that holds it."""
    root = Path(checkpoint_dir)
    index_file = root / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{index_file} is not a valid safetensors index (a JSON object with a weight_map): {err}. Copy or"
                " download the checkpoint again."
            ) from None
        absent = sorted({file for file in weight_map.values() if not (root / file).is_file()})
        if absent:
            raise FileNotFoundError(
                f"{index_file} names {len(absent)} shard(s) that are not in {root}: {', '.join(absent[:5])}. The"
                " download or copy is incomplete: fetch the missing files (every file the index names)."
            )
        return {name: root / file for name, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"No *.safetensors files in {root}. Pass an HF checkpoint directory saved with `save_pretrained`"
            " (safe_serialization, the default)."
        )
    index: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            index.update(dict.fromkeys(handle.keys(), file))
    return index


def _local_slices(tensor: torch.Tensor) -> tuple[slice, ...]:
    if not isinstance(tensor, DTensor):
        return tuple(slice(None) for _ in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


@torch.no_grad()
def load_sharded_safetensors(
    model: nn.Module, checkpoint_dir: str | Path, device: torch.device | str | None = None
) -> None:
    """Give a meta-device (parallelized) model storage and fill each rank's shards from the checkpoint.

    Args:
        model: The model, typically after :func:`~lightning_plugins.parallelize` on the meta device.
        checkpoint_dir: An HF checkpoint directory (``*.safetensors``, optionally sharded with an index).
        device: Where the local shards live; defaults to the mesh's device type (``cpu`` / ``cuda``).

    Raises:
        KeyError: when the checkpoint lacks a parameter of the model (names are listed).
    """
    mesh = mesh_of(model)
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if mesh is not None and mesh.device_type == "cuda"
            else "cpu"
        )
    index = checkpoint_index(checkpoint_dir)
    state = dict(model.named_parameters())
    state.update((name, buf) for name, buf in model.named_buffers() if _is_persistent(model, name))
    sources = _hub_sources(model, state, index, checkpoint_dir)
    missing = sorted(name for source in sources.values() for name in _names(source) if name not in index)
    if any(".lora_" in name or ".base_layer." in name for name in missing):
        raise LayoutError(
            f"The model is a peft (LoRA) model on the meta device, but {checkpoint_dir} is an HF checkpoint: it holds"
            " no adapter weights, and its base weights are not under peft's names. Build the base model with its"
            " weights (`AutoModelForCausalLM.from_pretrained`) and then `get_peft_model`, or build it on the meta"
            " device without adapters."
        )
    if missing:
        raise KeyError(
            f"The checkpoint in {checkpoint_dir} lacks {len(missing)} tensors of the model, e.g. {missing[:5]}."
        )
    _check_shapes(state, index, sources)  # before any storage is touched: nothing is half-loaded
    # `to_empty` gives every module its own new tensor, which would untie shared weights (tied
    # embeddings): remember who shares what and tie them again.
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    for owner_name, others in shared.items():
        for name in others:
            module_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_name), leaf, model.get_parameter(owner_name))
    state = dict(model.named_parameters())
    state.update((name, buf) for name, buf in model.named_buffers() if _is_persistent(model, name))
    handles: dict[Path, Any] = {}
    try:

        def get_slice(name: str) -> Any:
            file = index[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            return handles[file].get_slice(name)

        for name, tensor in state.items():
            source = sources[name]
            if isinstance(source, StackedExperts):
                piece = source.read(get_slice, _local_slices(tensor), tensor.shape)
            elif isinstance(source, Mxfp4Experts):
                piece = source.read(get_slice, _local_slices(tensor), tensor.shape, tensor.dtype)
            else:
                piece = get_slice(source)[_local_slices(tensor)]
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            local.copy_(piece.to(dtype=local.dtype))
    finally:
        handles.clear()
    _reinit_nonpersistent_buffers(model, device)
    if any(isinstance(source, Mxfp4Experts) for source in sources.values()):
        forget_mxfp4(model.config)


Source = str | StackedExperts | Mxfp4Experts


def _hub_sources(
    model: nn.Module, state: dict[str, torch.Tensor], index: dict[str, Path], checkpoint_dir: str | Path
) -> dict[str, Source]:
    """Where each tensor of ``state`` is in the checkpoint: under its own name, as MXFP4 blocks and scales (see
    :mod:`.mxfp4`), or (a checkpoint in the hub's layout, as ``save_pretrained`` writes it) under the names
    transformers converts it from (see :mod:`.hub_names`); a text decoder's in a multimodal checkpoint under the
    multimodal model's names (see :mod:`.text_tower`)."""
    whole = checkpoint_config(checkpoint_dir)
    if whole is not None and is_multimodal(whole) and not is_multimodal(getattr(model, "config", None)):
        return dict(tower_sources(model, whole, {name: tensor.shape for name, tensor in state.items()}, index))
    return {
        name: name
        if name in index
        else mxfp4_source(name, index, tensor) or hub_source(model, name, tensor.shape)
        for name, tensor in state.items()
    }


def _names(source: Source) -> list[str]:
    return [source] if isinstance(source, str) else source.names()


def _check_shapes(state: dict[str, torch.Tensor], index: dict[str, Path], sources: dict[str, Source]) -> None:
    """Every tensor the model needs is readable in its file with the model's (global) shape."""
    expected: dict[str, list[int]] = {}
    for name, tensor in state.items():
        source = sources[name]
        if isinstance(source, StackedExperts):
            for rows, leaf in zip(source.rows, source.leaves):
                expected.update(dict.fromkeys(leaf, [rows, *tensor.shape[2:]]))
        elif isinstance(source, Mxfp4Experts):
            expected.update(source.shapes(tensor.shape))
        else:
            expected[source] = list(tensor.shape)
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(index[name], []).append(name)
    wrong = []
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as handle:
                wrong += [
                    (name, shape)
                    for name in names
                    if (shape := handle.get_slice(name).get_shape()) != expected[name]
                ]
        except Exception as err:  # safetensors' own error type is not exported
            raise ValueError(
                f"{file} cannot be read as safetensors ({type(err).__name__}: {err}); it is truncated or corrupted."
                " Copy or download it again."
            ) from None
    if wrong:
        shown = ", ".join(f"{name} {shape} (model: {expected[name]})" for name, shape in wrong[:3])
        raise ValueError(
            f"The checkpoint in {index[wrong[0][0]].parent} holds {len(wrong)} tensor(s) of another shape than the model"
            f" built from its config: {shown}. It belongs to a different model: check model.path and its config.json."
        )


def _shared_parameters(model: nn.Module) -> dict[str, list[str]]:
    """First name of each parameter held under several names -> its other names."""
    first: dict[int, str] = {}
    shared: dict[str, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            shared.setdefault(first[id(param)], []).append(name)
        else:
            first[id(param)] = name
    return shared


def _is_persistent(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf not in module._non_persistent_buffers_set


def _reinit_nonpersistent_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Recompute buffers that are not in checkpoints: rotary frequencies by rebuilding their module, a scalar kept
    beside its buffer (Gemma 3's ``embed_scale``, kept as ``scalar_embed_scale``) from that scalar."""
    for module in model.modules():
        scalars = {name for name in module._non_persistent_buffers_set if hasattr(module, f"scalar_{name}")}
        for name in scalars:
            value, dtype = getattr(module, f"scalar_{name}"), getattr(module, name).dtype
            setattr(module, name, torch.tensor(value, dtype=dtype, device=device))
        rest = module._non_persistent_buffers_set - scalars
        if not rest:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise LayoutError(
                f"{type(module).__name__} has non-persistent buffers {sorted(rest)} that"
                " cannot be recomputed after meta-device loading; build this model materialised instead."
            )
        with torch.device(device):
            fresh = type(module)(config=config)
        for name in rest:
            setattr(module, name, getattr(fresh, name))


def checkpoint_dir_of(model: nn.Module, load_from: str | Path | None, owner: str) -> Path:
    """Where a meta-device model's weights are: ``load_from``, else the config's ``name_or_path``.

    Raises:
        LayoutError: if neither is a local directory, naming the fix.
    """
    source = load_from or getattr(model.config, "name_or_path", None)
    if not source or not Path(source).is_dir():
        raise LayoutError(
            f"{owner}: the model is on the meta device but no local HF checkpoint directory is known"
            f" (config.name_or_path={source!r}). Pass `load_from=<dir with *.safetensors>`."
        )
    return Path(source)


def parallelize_and_load(
    module: nn.Module,
    model: nn.Module,
    mesh: DeviceMesh,
    options: ParallelOptions | None,
    memory: MemoryOptions | None,
    *,
    load_from: str | Path | None,
    owner: str,
    device: torch.device | str | None = None,
    apply: bool = True,
) -> None:
    """Apply the layout to the HF ``model`` inside ``module``, then, when it was built on the meta device, fill this
    rank's slices from its checkpoint: the one path both doors take to parallelize a model (meta or not).

    Args:
        module: What holds ``model`` (the LightningModule, the prepared module): a peft ``PeftModel`` in it around
            ``model`` is what gets parallelized (see :func:`~lightning_plugins.adapters.lora.peft_model_around`).
        model: The transformers model.
        mesh: The door's device mesh.
        options: How each dimension is applied.
        memory: The memory levers.
        load_from: The checkpoint directory of a meta-device model (default: the config's ``name_or_path``).
        owner: Named in errors.
        device: Where the loaded shards live (default: the mesh's device type).
        apply: ``False`` when ``model`` is parallelized already (by the user's own code): only load.

    Raises:
        LayoutError: before anything is parallelized, when the model is on the meta device and no checkpoint
            directory is known.
    """
    from lightning_plugins.adapters.lora import peft_model_around

    checkpoint = checkpoint_dir_of(model, load_from, owner) if is_on_meta(model) else None
    if apply:
        parallelize(peft_model_around(module, model), mesh, options, memory)
    if checkpoint is not None:
        load_sharded_safetensors(model, checkpoint, device)


def from_pretrained(
    checkpoint_dir: str | Path,
    layout: ParallelLayout | DeviceMesh,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Build an HF causal LM on the meta device, parallelize it, and load this rank's slices.

    Args:
        checkpoint_dir: A local HF checkpoint directory (config.json + safetensors).
        layout: The layout or mesh (see :func:`~lightning_plugins.parallelize`).
        dtype: Parameter dtype.
        attn_implementation: e.g. ``"sdpa"`` or ``"eager"``; the config's choice when ``None``.
        options: How the layout is applied (see :func:`~lightning_plugins.parallelize`).
        memory: Memory levers (see :func:`~lightning_plugins.parallelize`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = text_config(AutoConfig.from_pretrained(checkpoint_dir))  # a multimodal checkpoint: its text decoder
    with torch.device("meta"):
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    parallelize(model, layout, options, memory)
    load_sharded_safetensors(model, checkpoint_dir)
    return model
