"""MXFP4 expert weights on the hub, read as dense weights in the model's dtype.

The gpt-oss checkpoints store each experts module's ``gate_up_proj`` / ``down_proj`` as ``<name>_blocks`` (uint8,
two FP4 values per byte, ``(experts, out, in / 32, 16)``) and ``<name>_scales`` (uint8 E8M0 exponents, one per
32 values, ``(experts, out, in / 32)``), and their config carries ``quantization_config: {quant_method: mxfp4}``.
transformers 5's ``GptOssExperts`` holds the dense ``(experts, in, out)`` parameter; transformers' own
dequantization (:func:`transformers.integrations.mxfp4.convert_moe_packed_tensors`, what
``Mxfp4Config(dequantize=True)`` runs) turns a block and its scales into exactly that, so a rank reads the blocks and
scales of the experts it holds, dequantizes them with it, and keeps its rows and columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_plugins.errors import CheckpointError

__all__ = ["DEQUANTIZABLE", "Mxfp4Experts", "check_mxfp4", "dequantized", "forget_mxfp4", "is_mxfp4", "mxfp4_source"]

#: The dtypes transformers' MXFP4 dequantization can produce (a float lookup table and ``torch.ldexp``).
DEQUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_BLOCK = 32  # values per E8M0 scale (16 bytes of packed FP4 pairs)


@dataclass(frozen=True)
class Mxfp4Experts:
    """A fused experts parameter ``(experts, in, out)`` stored as MXFP4 ``blocks`` and ``scales``."""

    blocks: str
    scales: str

    def names(self) -> list[str]:
        return [self.blocks, self.scales]

    def shapes(self, shape: torch.Size) -> dict[str, list[int]]:
        """The checkpoint shapes of :meth:`names` for a parameter of global ``shape``."""
        experts, rows_in, cols_out = shape
        groups = rows_in // _BLOCK
        return {self.blocks: [experts, cols_out, groups, _BLOCK // 2], self.scales: [experts, cols_out, groups]}

    def read(
        self, get_slice: Callable[[str], object], index: tuple[slice, ...], shape: torch.Size, dtype: torch.dtype
    ) -> Tensor:
        """The ``index`` slice of the dequantized parameter of global ``shape``, in ``dtype``: only the held experts'
        blocks and scales are read (each expert's whole matrix is dequantized, then cut to ``index[1:]``)."""
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        experts = index[0]
        blocks = get_slice(self.blocks)[experts]
        scales = get_slice(self.scales)[experts]
        if blocks.shape[0] == 0:
            return torch.empty(0, *shape[1:], dtype=dtype)[(slice(None), *index[1:])]
        return convert_moe_packed_tensors(blocks, scales, dtype=dtype)[(slice(None), *index[1:])]


def mxfp4_source(name: str, names: set[str] | dict[str, object], tensor: Tensor) -> Mxfp4Experts | None:
    """``name``'s MXFP4 blocks and scales when the checkpoint holds them instead of ``name`` (else ``None``).

    Args:
        name: The parameter's name in the model.
        names: The checkpoint's tensor names.
        tensor: The parameter (its global shape and dtype; on the meta device is enough).

    Raises:
        CheckpointError: when only one of the two is there, the parameter is not ``(experts, in, out)`` with ``in`` a
            multiple of 32, or its dtype is not one the dequantization gives.
    """
    shape = tensor.shape
    blocks, scales = f"{name}_blocks", f"{name}_scales"
    if blocks not in names and scales not in names:
        return None
    if blocks not in names or scales not in names:
        raise CheckpointError(
            f"The checkpoint holds {blocks if blocks in names else scales} but not"
            f" {scales if blocks in names else blocks}: an MXFP4 weight needs both. The download is incomplete or the"
            " checkpoint was written by another tool: fetch it again."
        )
    if len(shape) != 3 or shape[1] % _BLOCK:
        raise CheckpointError(
            f"{name} {tuple(shape)} is stored in MXFP4 on disk, which this loader reads only for fused experts"
            f" (experts, in, out) with `in` a multiple of {_BLOCK}. Dequantize the checkpoint with transformers"
            " (`from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))` then `save_pretrained`)."
        )
    _check_dtype(tensor.dtype, blocks)
    return Mxfp4Experts(blocks, scales)


def is_mxfp4(config: object) -> bool:
    """Whether a transformers config says its checkpoint holds MXFP4 weights (gpt-oss on the hub)."""
    quantization = getattr(config, "quantization_config", None)
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    return str(getattr(method, "value", method)) == "mxfp4"


def check_mxfp4(config: object, dtype: torch.dtype, quantize: str = "none") -> None:
    """An MXFP4 checkpoint trains dequantized: in a dtype the dequantization gives, and not re-quantized to NF4.

    Raises:
        CheckpointError: naming the setting and what works.
    """
    if not is_mxfp4(config):
        return
    _check_dtype(dtype, f"{getattr(config, 'model_type', 'the model')}'s checkpoint")
    if quantize == "nf4":
        raise CheckpointError(
            f"{getattr(config, 'model_type', 'the model')}'s checkpoint stores its experts in MXFP4, which loads"
            " dequantized (dense) for training; QLoRA (lora.quantize: nf4) would quantize those values a second time"
            " into another 4-bit format. Use LoRA on the dequantized weights (lora.quantize: none)."
        )


def dequantized(config: object) -> dict[str, object]:
    """The keyword for transformers' ``from_pretrained`` that loads an MXFP4 checkpoint dense (in the ``dtype`` it is
    given) rather than as MXFP4 modules that do not train; nothing for other checkpoints."""
    if not is_mxfp4(config):
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def forget_mxfp4(config: object) -> None:
    """Drop the MXFP4 ``quantization_config`` of a model loaded dequantized (as transformers does with
    ``Mxfp4Config(dequantize=True)``): the model is dense now, and what it saves or exports must load as dense."""
    if is_mxfp4(config):
        del config.quantization_config  # type: ignore[attr-defined]


def _check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in DEQUANTIZABLE:
        raise CheckpointError(
            f"{what} is MXFP4 and loads dequantized, which gives {', '.join(map(str, DEQUANTIZABLE))}, not {dtype}."
            " Build the model in one of those dtypes (recipe model.dtype, or from_pretrained's dtype)."
        )
