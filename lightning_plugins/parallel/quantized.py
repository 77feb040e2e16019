"""What a layout needs to know about NF4 base weights (QLoRA): which parameters are NF4, and which layouts they take.

The quantization itself (peft's LoRA model, :func:`~lightning_plugins.adapters.qlora.quantize_base_to_nf4`) lives in
:mod:`lightning_plugins.adapters`, which imports this module: the engine refuses a layout an NF4 base cannot take
without importing the adapters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_plugins.errors import LayoutError, OptionsError
from lightning_plugins.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from torchao.quantization import NF4Tensor

__all__ = ["FLOAT8_WITH_NF4", "check_quantized", "is_nf4", "nf4_tensor_type", "nf4_weights"]

#: Why float8 linears and an NF4 base do not compose, and the fix (the recipe's keys and the engine's options).
FLOAT8_WITH_NF4 = (
    "float8=True (parallel.float8) with NF4 base weights (QLoRA, lora.quantize: nf4) is not supported: torchao's"
    " Float8Linear casts a dense bf16 weight to float8 at each step, and an NF4 weight is 4-bit codes dequantized"
    " at each matmul, which no float8 kernel takes. Set parallel.float8: false (float8=False) for QLoRA, or"
    " lora.quantize: none to train LoRA on a bf16 base with float8."
)

def nf4_tensor_type() -> type:
    """torchao's ``NF4Tensor``, imported on first use: QLoRA is optional.

    ``lightning_plugins/__init__.py`` has already imported torchao with its import-time log noise muted.
    """
    from torchao.quantization import NF4Tensor

    return NF4Tensor


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_nf4(tensor: Tensor) -> bool:
    """Whether ``tensor`` (or, for a DTensor, its local shard) is an ``NF4Tensor``."""
    return isinstance(_local(tensor), nf4_tensor_type())


def nf4_weights(model: nn.Module) -> Iterator[tuple[str, NF4Tensor]]:
    """``(name, weight)`` for each NF4 parameter of ``model``; a sharded one yields its local ``NF4Tensor``."""
    for name, param in model.named_parameters():
        if is_nf4(param):
            yield name, _local(param)


def check_quantized(model: nn.Module, layout: ParallelLayout, float8: bool = False) -> None:
    """Refuse a layout that NF4 base weights cannot take, before any collective runs.

    Call from ``parallelize`` after the layout is resolved; a model without NF4 weights passes at once.

    Args:
        model: The model about to be parallelized.
        layout: A resolved layout (``dp_shard_size`` not ``-1``).
        float8: Whether float8 linears were asked for (``ParallelOptions.float8``).

    Raises:
        OptionsError: with ``float8``: an NF4 base cannot be a float8 linear.
        LayoutError: under tensor parallelism (naming a layout of the same world size that works), or when
            FSDP2 cannot split a weight into equal shards of whole rows and whole scaler groups (naming the
            weight, its shape, the shard count and the fix).
    """
    weights = dict(nf4_weights(model))
    if not weights:
        return
    if float8:
        raise OptionsError(FLOAT8_WITH_NF4)
    if layout.dp_shard_size == -1:
        raise LayoutError("check_quantized needs a resolved layout: call `layout.resolve(world_size)` first.")
    if layout.tp_size > 1:
        raise LayoutError(_tensor_parallel_message(next(iter(weights)), weights, layout))
    problem = _first_unshardable(weights, layout.dp_shard_size * layout.cp_size)
    if problem is not None:
        raise LayoutError(problem)


def _first_unshardable(weights: dict[str, NF4Tensor], shards: int) -> str | None:
    """Why the first weight that FSDP2 cannot split over ``shards`` ranks fails (``None`` if all split)."""
    if shards == 1:
        return None
    for name, weight in weights.items():
        rows, blocks = weight.shape[0], weight.numel() // weight.block_size
        groups = blocks // weight.scaler_block_size
        if rows % shards == 0 and groups % shards == 0:
            continue
        fits = math.gcd(rows, groups)
        ranks = [n for n in range(2, fits + 1) if fits % n == 0]
        fix = f"use a shard count that divides {fits} ({ranks})" if ranks else "use dp_shard_size=1 and cp_size=1"
        if rows % shards == 0:
            sizes = _powers_of_two_down(weight.scaler_block_size)
            size = next((s for s in sizes if blocks % s == 0 and (blocks // s) % shards == 0), None)
            if size is not None:
                fix = f"quantize with scaler_block_size={size} (or None: a shardable size per weight), or {fix}"
        return (
            f"QLoRA: the NF4 weight {name} of shape {tuple(weight.shape)} ({blocks} blocks of {weight.block_size},"
            f" double-quantized in {groups} groups of {weight.scaler_block_size} blocks) cannot be sharded over"
            f" {shards} FSDP2 ranks (dp_shard_size x cp_size): FSDP2 splits dim 0 into equal shards that must hold"
            f" whole rows and whole scaler groups ({rows} rows, {groups} groups). Fix: {fix}."
        )
    return None


def _powers_of_two_down(start: int) -> Iterator[int]:
    size = 1 << (start.bit_length() - 1)
    while size >= 1:
        yield size
        size //= 2


def _tensor_parallel_message(name: str, weights: dict[str, NF4Tensor], layout: ParallelLayout) -> str:
    """The refusal of TP for NF4 weights, with a layout of the same world size that works."""
    replicas, shards = layout.dp_replicate_size, layout.dp_shard_size * layout.tp_size  # fold TP's ranks into FSDP2
    if _first_unshardable(weights, shards * layout.cp_size) is not None:
        replicas, shards = replicas * layout.tp_size, layout.dp_shard_size  # replicas split no weight at all
    sizes = {
        "pp_size": layout.pp_size, "dp_replicate_size": replicas, "dp_shard_size": shards, "cp_size": layout.cp_size
    }
    shown = ", ".join(f"{key}={value}" for key, value in sizes.items() if value > 1 or key == "dp_shard_size")
    return (
        f"QLoRA: NF4 base weights (e.g. {name}) do not compose with tensor parallelism (tp_size={layout.tp_size}):"
        " a row-parallel split cuts through NF4's row-major quantization blocks and double-quantized scaler"
        " groups, and torchao's NF4Tensor supports neither that split nor a column-parallel DTensor matmul."
        " QLoRA composes with FSDP2 (dp_shard_size, HSDP), context parallelism and pipeline parallelism: use"
        f" ParallelLayout({shown}) for the same {layout.world_size} ranks, or LoRA without quantization under"
        " tensor parallelism."
    )
