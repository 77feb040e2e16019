"""QLoRA's NF4 base weights read from a checkpoint: each rank quantizes only the rows it keeps.

NF4 (torchao's ``to_nf4``, :mod:`lightning_plugins.adapters.qlora`) quantizes a weight in blocks of ``block_size``
consecutive values, each scaled by its absmax, and then quantizes those absmaxes again in groups
(``scaler_block_size`` of them) after subtracting their mean over the *whole* weight. Everything but that mean is
local to the blocks and groups a row range holds (FSDP2 shards NF4 weights along rows, in whole blocks and groups).
So a rank reads the whole weight once in bounded chunks to take every block's absmax (a 64th of the values), takes
their mean exactly as one process does, then reads and quantizes its own rows only: its shard equals, bit for bit,
the same rows of the weight one process quantizes whole, no rank ever holds the weight whole, and the quantization
(the costly part) is split over the ranks.
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
from torch import Tensor

from lightning_plugins.checkpoint import safetensors_io
from lightning_plugins.checkpoint.safetensors_io import LazySlice

__all__ = ["quantize_rows"]


@functools.cache
def _nf4_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """The 16 NF4 levels as torchao stores them (read off a quantized weight, not retyped)."""
    from torchao.quantization import to_nf4

    return to_nf4(torch.ones(2, dtype=dtype, device=device), 2, 1).nf4


def quantize_rows(weight: LazySlice, rows: slice, like: Tensor, device: torch.device | str) -> Tensor:
    """Rows ``rows`` of the checkpoint's ``weight``, quantized to NF4 as torchao's ``to_nf4`` quantizes the whole.

    Args:
        weight: The checkpoint's tensor (2-D).
        rows: The rows this rank keeps (all of them without FSDP2).
        like: The NF4 weight of the model (on the meta device): its dtype, block and scaler block sizes.
        device: Where the result lives (the mesh's device: the quantization runs there).
    """
    from torchao.quantization import NF4Tensor

    home = importlib.import_module(NF4Tensor.__module__)  # wherever this torchao keeps it (as adapters.qlora does)
    SubclassTensorArgs, get_block_absmax = home.SubclassTensorArgs, home.get_block_absmax  # noqa: N806

    dtype, block, group = like.dtype, like.block_size, like.scaler_block_size
    total, *rest = weight.get_shape()
    width = math.prod(rest)
    unit = block // math.gcd(width, block)  # rows per chunk: whole blocks
    step = max(unit, safetensors_io.CHUNK_BYTES // max(1, width * like.element_size()) // unit * unit)

    def read(start: int, stop: int) -> Tensor:
        return weight[(slice(start, stop),)].to(device=device, dtype=dtype)

    chunks = range(0, total, step)
    absmax = torch.cat([get_block_absmax(read(a, min(a + step, total)).flatten(), block) for a in chunks])
    mean = absmax.mean()  # over every block of the weight, as one process takes it
    lo, hi, _ = rows.indices(total)
    local = read(lo, hi)
    centred = absmax[lo * width // block : hi * width // block] - mean
    groups = centred.view(-1, group)
    factor = 256 / (2 * get_block_absmax(centred, group))
    scalers = (groups * factor.unsqueeze(-1)).round().clamp(-128, 127).flatten().to(torch.int8)
    blocks = local.numel() // block
    table = _nf4_table(dtype, torch.device(device))
    codes = NF4Tensor.convert_to_norm_float_weight(local, blocks, block, table)
    meta = SubclassTensorArgs(local.size(), local.stride(), 0, dtype, local.device, False)
    return NF4Tensor(meta, block, blocks, group, scalers, factor.contiguous(), mean, codes, nf4=table)
