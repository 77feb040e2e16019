"""Where a model's parameter lives in an HF checkpoint written in the hub's layout.

transformers 5 fuses some weights at load time and splits them again in ``save_pretrained`` (its
``conversion_mapping``): a mixture-of-experts layer's experts are one 3-D ``experts.gate_up_proj`` /
``experts.down_proj`` in the model, but per-expert 2-D ``experts.<e>.w1.weight`` (Mixtral; its
``mlp`` is ``block_sparse_moe`` on disk) or ``experts.<e>.gate_proj.weight`` (Qwen-MoE) on the hub and in
what ``save_pretrained`` writes. Asking transformers' own ``revert_weight_conversion`` about a meta tensor
of the parameter's shape names those tensors without touching any data; a rank then reads only the
rows of the experts it holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_plugins.errors import CheckpointError

__all__ = ["StackedExperts", "hub_source", "in_hub_layout"]

#: ``(shape, dtype)`` of a tensor to be written (as :data:`~lightning_plugins.checkpoint.safetensors_io.TensorSpec`).
Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class StackedExperts:
    """A fused experts parameter ``(experts, rows, ...)`` stored as 2-D tensors per expert.

    ``leaves[k][e]`` is the checkpoint name of expert ``e``'s ``k``-th part; expert ``e``'s slice of the
    parameter is its parts concatenated along their first dimension (gate then up for ``gate_up_proj``).
    """

    leaves: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]

    def names(self) -> list[str]:
        return [name for leaf in self.leaves for name in leaf]

    def split(self, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
        """``(name, part)`` of the full fused ``tensor``, in the order of :meth:`names`."""
        start = 0
        for leaf, rows in zip(self.leaves, self.rows):
            for expert, name in enumerate(leaf):
                yield name, tensor[expert, start : start + rows]
            start += rows

    def read(self, get_slice: Callable[[str], object], index: tuple[slice, ...], shape: torch.Size) -> Tensor:
        """The ``index`` slice (one ``slice`` per dimension) of the fused parameter of global ``shape``, read
        through ``get_slice(name)`` (safetensors' lazy slices): only the wanted experts and rows are read."""
        experts = range(*index[0].indices(shape[0]))
        row_lo, row_hi, _ = index[1].indices(shape[1])
        rest = tuple(index[2:])
        stacked = []
        for expert in experts:
            parts, start = [], 0
            for leaf, rows in zip(self.leaves, self.rows):
                lo, hi = max(row_lo - start, 0), min(row_hi - start, rows)
                if lo < hi:
                    parts.append(get_slice(leaf[expert])[(slice(lo, hi), *rest)])
                start += rows
            stacked.append(torch.cat(parts))
        if not stacked:
            return torch.empty(0, row_hi - row_lo, *shape[2:])
        return torch.stack(stacked)


def hub_source(model: nn.Module, name: str, shape: torch.Size) -> str | StackedExperts:
    """The checkpoint name(s) that ``save_pretrained`` writes for parameter ``name`` of global ``shape``.

    Raises:
        CheckpointError: when transformers splits the parameter in a way other than per-expert rows.
    """
    from transformers.core_model_loading import revert_weight_conversion

    pieces = revert_weight_conversion(_unsharded_twin(model), {name: torch.empty(shape, device="meta")})
    if len(pieces) == 1:
        return next(iter(pieces))
    experts = shape[0]
    names = list(pieces)
    if len(names) % experts:
        raise CheckpointError(_unsupported(name, shape, pieces))
    leaves = tuple(tuple(names[k : k + experts]) for k in range(0, len(names), experts))
    rows = tuple(pieces[leaf[0]].shape[0] for leaf in leaves)
    consistent = all(
        tuple(pieces[n].shape) == (r, *shape[2:]) for leaf, r in zip(leaves, rows) for n in leaf
    ) and sum(rows) == shape[1]
    if not consistent:
        raise CheckpointError(_unsupported(name, shape, pieces))
    return StackedExperts(leaves, rows)


_TWINS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def _unsharded_twin(model: nn.Module) -> nn.Module:
    """``model``, or for one under FSDP2 or pipeline parallelism a meta-device model of its own class: transformers
    finds a model's renamings by its modules' class names (Gemma 3's ``language_model.model`` on disk), which
    ``fully_shard`` changes to ``FSDP<name>`` and a pipeline to ``Pipelined<name>`` (its own class: the first one of
    transformers' in the class's bases)."""
    from torch.distributed.fsdp import FSDPModule

    hf = next((base for base in type(model).__mro__ if base.__module__.startswith("transformers.")), type(model))
    sharded = any(isinstance(module, FSDPModule) for module in model.modules())
    if not (sharded or hf is not type(model)) or not hasattr(model, "config"):
        return model
    if model not in _TWINS:
        cls = type(model)
        original = next((base for base in cls.__bases__ if base is not FSDPModule), cls) if issubclass(cls, FSDPModule) else cls
        original = hf if hf is not cls else original
        with torch.device("meta"):
            _TWINS[model] = original._from_config(model.config)
    return _TWINS[model]


def _unsupported(name: str, shape: torch.Size, pieces: dict[str, Tensor]) -> str:
    shown = ", ".join(f"{key} {tuple(value.shape)}" for key, value in list(pieces.items())[:4])
    return (
        f"transformers saves {name} {tuple(shape)} as {len(pieces)} tensors ({shown}, ...), not as per-expert rows"
        " this loader can slice. Load the model with transformers' from_pretrained in one process and save it with"
        " `save_pretrained(..., save_original_format=False)` to get the fused names."
    )


def in_hub_layout(
    model: nn.Module, specs: dict[str, Spec], produce: Callable[[list[str]], Iterator[tuple[str, Tensor]]]
) -> tuple[dict[str, Spec], Callable[[list[str]], Iterator[tuple[str, Tensor]]]]:
    """What ``save_pretrained`` of ``model`` writes for the tensors ``specs`` (model names), streamed.

    Args:
        model: The model (on the meta device is enough) whose conversions transformers reverts.
        specs: Model name -> ``(shape, dtype)``, in the order to write.
        produce: Yields ``(model name, full tensor)`` for a list of model names, in that order.

    Returns:
        The checkpoint names' specs (each fused experts tensor expanded into its per-expert parts, in place) and a
        ``produce`` for lists of those names in that order (a model tensor is read once per list it has parts in).
    """
    sources = {name: hub_source(model, name, torch.Size(shape)) for name, (shape, _) in specs.items()}
    hub_specs: dict[str, Spec] = {}
    owner: dict[str, str] = {}
    for name, source in sources.items():
        shape, dtype = specs[name]
        if isinstance(source, StackedExperts):
            for part, piece in source.split(torch.empty(shape, device="meta")):
                hub_specs[part], owner[part] = (tuple(piece.shape), dtype), name
        else:
            hub_specs[source], owner[source] = specs[name], name

    def hub_produce(chosen: list[str]) -> Iterator[tuple[str, Tensor]]:
        wanted = set(chosen)
        for name, tensor in produce(list(dict.fromkeys(owner[part] for part in chosen))):
            source = sources[name]
            if isinstance(source, StackedExperts):
                yield from ((part, piece) for part, piece in source.split(tensor) if part in wanted)
            else:
                yield source, tensor

    return hub_specs, hub_produce
