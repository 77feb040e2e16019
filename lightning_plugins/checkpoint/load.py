"""Meta-device models and sharded loading: each rank reads only its slices of the safetensors files.

No rank ever materialises the full model: the model is built on the meta device, parallelized (its
parameters become DTensors that know their global shape and placements), given empty local storage,
and each local shard is read from the file as its rows (a column shard: bounded chunks of rows, cut as they arrive;
:func:`.safetensors_io.read_slice`, no ``mmap``), one tensor at a time. Every path goes through here: a full
fine-tune, LoRA (adapters built real on the meta-device base, :mod:`lightning_plugins.adapters.meta_base`), QLoRA
(each rank quantizes the rows it keeps, :mod:`.nf4_rows`), experts under EP (a rank reads only its
experts), the text decoder of a multimodal checkpoint (:mod:`.text_tower`). A checkpoint in the hub's
layout (what transformers 5 ``save_pretrained`` writes: a mixture-of-experts layer's experts as per-expert 2-D
tensors, which transformers fuses into 3-D ones at load time) is read through :mod:`.hub_names`: a rank reads only
the experts (and rows) it holds; MXFP4 experts (gpt-oss on the hub) are read dequantized through :mod:`.mxfp4`.
"""

from __future__ import annotations

import ctypes
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_plugins.adapters.meta_base import ADAPTER_NAME
from lightning_plugins.checkpoint.hub_names import StackedExperts, hub_source
from lightning_plugins.checkpoint.nf4_rows import quantize_rows
from lightning_plugins.checkpoint.safetensors_io import LazySlice, read_header
from lightning_plugins.checkpoint.mxfp4 import Mxfp4Experts, forget_mxfp4, mxfp4_source
from lightning_plugins.checkpoint.text_tower import checkpoint_config, is_multimodal, text_config, tower_sources
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel import mesh_of, parallelize
from lightning_plugins.parallel.plan import ParallelPlan


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

    Only what is on the meta device is read: a peft model's base (its ``base_layer`` and ``modules_to_save`` copies
    under the checkpoint's names), while adapters built real (:func:`~lightning_plugins.adapters.lora.apply_lora` on
    a meta-device model) keep their values. Each tensor is read as this rank's slice, one at a time; of an NF4 weight
    (QLoRA) a rank quantizes its rows, bit for bit as one process quantizes the whole (:mod:`.nf4_rows`).

    Args:
        model: The model, typically after :func:`~lightning_plugins.parallelize` on the meta device.
        checkpoint_dir: An HF checkpoint directory (``*.safetensors``, optionally sharded with an index).
        device: Where the local shards live; defaults to the mesh's device type (``cpu`` / ``cuda``).

    Raises:
        KeyError: when the checkpoint lacks a parameter of the model (names are listed).
        LayoutError: when LoRA adapters are on the meta device (a checkpoint of the base holds none).
    """
    mesh = mesh_of(model)
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if mesh is not None and mesh.device_type == "cuda"
            else "cpu"
        )
    index = checkpoint_index(checkpoint_dir)
    todo = {name: tensor for name, tensor in _state(model).items() if _is_meta(tensor)}
    adapters = sorted(name for name in todo if ADAPTER_NAME.search(name))
    if adapters:
        raise LayoutError(
            f"The model's LoRA adapters are on the meta device ({adapters[0]}, ...), and {checkpoint_dir} is an HF"
            " checkpoint of the base: it holds no adapter weights. Build the adapters with"
            " `lightning_plugins.adapters.lora.apply_lora(model, LoraOptions(...))`, which creates them real on a"
            " meta-device model, or build the base with its weights (`AutoModelForCausalLM.from_pretrained`) before"
            " `get_peft_model`."
        )
    names = {name: checkpoint_name(name) for name in todo}
    sources = _hub_sources(model, {names[n]: t for n, t in todo.items()}, index, checkpoint_dir)
    missing = sorted(name for source in sources.values() for name in _names(source) if name not in index)
    if missing:
        raise KeyError(
            f"The checkpoint in {checkpoint_dir} lacks {len(missing)} tensors of the model, e.g. {missing[:5]}."
        )
    _check_shapes({names[n]: t for n, t in todo.items()}, index, sources)  # before any storage: nothing half-loaded
    _give_storage(model, device)
    state = _state(model)
    headers = {file: read_header(file) for file in sorted(set(index.values()))}

    def get_slice(name: str) -> LazySlice:
        header, start = headers[index[name]]
        return LazySlice(index[name], header[name], start)

    for name in todo:
        tensor, source = state[name], sources[names[name]]
        if _is_nf4(tensor):
            _load_nf4(model, name, tensor, get_slice(source), device)
            _release_freed_host_memory()  # the quantization's temporaries, of every size, would pile up in the heap
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if isinstance(source, StackedExperts):
            local.copy_(source.read(get_slice, _local_slices(tensor), tensor.shape))
        elif isinstance(source, Mxfp4Experts):
            local.copy_(source.read(get_slice, _local_slices(tensor), tensor.shape, tensor.dtype))
        else:
            get_slice(source).read_into(_local_slices(tensor), local)  # straight into the shard where it can
    _reinit_nonpersistent_buffers(model, device)
    if any(isinstance(source, Mxfp4Experts) for source in sources.values()):
        forget_mxfp4(model.config)
    _release_freed_host_memory()


def _release_freed_host_memory() -> None:
    """Hand the memory freed by the load's temporaries back to the system (glibc keeps freed blocks below its mmap
    threshold in the heap, where temporaries of changing sizes fragment it: a rank quantizing NF4 weights grew by
    the size of its temporaries per weight, 2.5x the memory it keeps). Nothing happens on another C library."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: What peft inserts into a base model's names (``q_proj.base_layer.weight``, ``gate.modules_to_save.default.weight``,
#: ``gate.original_module.weight``): the checkpoint names the same tensor without it.
_PEFT_PART = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def checkpoint_name(name: str) -> str:
    """The name in an HF checkpoint of the base tensor ``name`` of a (possibly peft-wrapped) transformers model."""
    return _PEFT_PART.sub("", name)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``model``, by its (first) name."""
    state = dict(model.named_parameters())
    state.update((name, buf) for name, buf in model.named_buffers() if _is_persistent(model, name))
    return state


def _is_meta(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.is_meta or (_is_nf4(local) and local.quantized_data.is_meta)


def _is_nf4(tensor: torch.Tensor) -> bool:
    if "torchao" not in sys.modules:
        return False
    from lightning_plugins.parallel.quantized import is_nf4

    return is_nf4(tensor)


def _give_storage(model: nn.Module, device: torch.device | str) -> None:
    """Empty storage on ``device`` for every meta tensor of ``model`` (not NF4 weights: :func:`_load_nf4` makes
    those); a tensor held under several names (tied embeddings) stays one tensor."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in list(store.items()):
                if tensor is None or not _is_meta(tensor) or _is_nf4(tensor):
                    continue
                if id(tensor) not in done:
                    empty = torch.empty_like(tensor, device=device)
                    done[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
                store[name] = done[id(tensor)]


def _load_nf4(
    model: nn.Module, name: str, tensor: torch.Tensor, weight: LazySlice, device: torch.device | str
) -> None:
    """Quantize this rank's rows of the checkpoint's ``weight`` as the meta NF4 ``tensor`` says (its dtype, block and
    scaler block sizes; FSDP2's dim-0 shard, :mod:`.nf4_rows`) and put the result in place of ``tensor``."""
    meta = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    rows, *rest = _local_slices(tensor)
    if any(part.indices(size)[:2] != (0, size) for part, size in zip(rest, tensor.shape[1:])):
        raise LayoutError(f"{name}: an NF4 weight is sharded along dim 0 only (FSDP2), not {tensor.placements}.")
    nf4 = quantize_rows(weight, rows, meta, device)
    if isinstance(tensor, DTensor):
        nf4 = DTensor.from_local(
            nf4, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    replacement = nn.Parameter(nf4, requires_grad=False)
    for module in model.modules():
        for leaf, param in list(module._parameters.items()):
            if param is tensor:
                module._parameters[leaf] = replacement


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
    mesh: ParallelPlan | DeviceMesh,
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
            ``model`` is what gets parallelized (see :func:`~lightning_plugins.parallel.hf_model.peft_model_around`).
        model: The transformers model.
        mesh: The door's plan (:func:`~lightning_plugins.parallel.plan.resolve`), or its device mesh.
        options: How each dimension is applied (``None`` with a plan: the plan's).
        memory: The memory levers (``None`` with a plan: the plan's).
        load_from: The checkpoint directory of a meta-device model (default: the config's ``name_or_path``).
        owner: Named in errors.
        device: Where the loaded shards live (default: the mesh's device type).
        apply: ``False`` when ``model`` is parallelized already (by the user's own code): only load.

    Raises:
        LayoutError: before anything is parallelized, when the model is on the meta device and no checkpoint
            directory is known.
    """
    from lightning_plugins.parallel.hf_model import peft_model_around

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
