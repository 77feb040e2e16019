"""Lightning's ``ModelParallelStrategy`` habits on this project's strategies.

A module written for ``ModelParallelStrategy`` reads ``self.device_mesh["data_parallel"]`` and
``self.device_mesh["tensor_parallel"]`` (Lightning's names) and may parallelize its model itself in
``configure_model`` (``parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)``, as Lightning's TP
guide does); its strategy takes ``data_parallel_size`` / ``tensor_parallel_size``. Here the mesh carries those names
next to the engine's (:func:`add_lightning_names`), the strategies take those sizes (:func:`lightning_sizes`), and a
model that the module parallelized by hand is kept as it is, with FSDP2 over the data ranks and activation
checkpointing added by the engine (:func:`check_parallelized_by_user`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.by_hand import check_split_by_hand, split_by_hand
from lightning_plugins.parallel.layout import ParallelLayout, add_dimension_names

#: Lightning's mesh dimension name -> the engine's dimensions it spans (``data_parallel``: ranks that see different
#: samples, the engine's ``dp``).
LIGHTNING_DIMS = {"data_parallel": ("dp_replicate", "dp_shard"), "tensor_parallel": ("tp",)}


def add_lightning_names(mesh: DeviceMesh) -> DeviceMesh:
    """Give ``mesh`` (the strategy's plan's, or one built by ``ParallelLayout.build_mesh``) Lightning's dimension names
    as flattened views (the same mesh object: its plan is still found from it)."""
    return add_dimension_names(mesh, LIGHTNING_DIMS)


def lightning_sizes(
    owner: str, sizes: dict[str, Any], data_parallel_size: int | str | None, tensor_parallel_size: int | str | None
) -> dict[str, Any]:
    """``sizes`` (``tp_size``, ``dp_shard_size``, ...) with ``ModelParallelStrategy``'s size arguments mapped in.

    ``tensor_parallel_size`` is ``tp_size``; ``data_parallel_size`` is ``dp_shard_size`` (Lightning shards the data
    ranks with FSDP2). ``"auto"``: ``tensor_parallel_size`` takes every process of a node (as Lightning's does; it is
    returned as ``"auto"`` for the strategy to resolve), ``data_parallel_size`` whatever the world leaves (-1).

    Raises:
        LayoutError: when a size is given under both names with different values.
    """
    sizes = dict(sizes)
    for lightning_name, value, ours in (
        ("tensor_parallel_size", tensor_parallel_size, "tp_size"),
        ("data_parallel_size", data_parallel_size, "dp_shard_size"),
    ):
        if value is None:
            continue
        if value == "auto":
            value = "auto" if ours == "tp_size" else -1
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LayoutError(f"{owner}: {lightning_name} must be a positive integer or 'auto', got {value!r}.")
        if sizes.get(ours) is not None and sizes[ours] != value:
            raise LayoutError(
                f"{owner}: {lightning_name}={value!r} (Lightning's name) and {ours}={sizes[ours]!r} disagree; they are"
                f" the same size. Give one of them."
            )
        sizes[ours] = value
    return sizes


def parallelized_by_user(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters that the engine did not make (the module's own ``configure_model``
    called ``parallelize_module`` / ``fully_shard``)."""
    return split_by_hand(model)


def check_parallelized_by_user(owner: str, model: nn.Module, layout: ParallelLayout, options: Any = None) -> None:
    """Refuse what the strategy cannot add to a model that the module parallelized itself.

    The model is kept as it is: its tensor parallelism is the module's plan. The strategy adds FSDP2 over the data
    ranks (unless the module sharded them itself) and activation checkpointing
    (:func:`~lightning_plugins.parallel.by_hand.complete_split_by_hand`); a pipeline, context or expert size cannot be
    added to it.

    Raises:
        LayoutError: naming the dimension and the fix.
    """
    check_split_by_hand(owner, model, layout, options)
