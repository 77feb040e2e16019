"""A lean NF4 linear: the QLoRA base's matmul without the dense weight or the dequantization's transients.

torchao's ``NF4Tensor`` routes ``F.linear`` to ``LinearNF4``, which dequantizes the whole weight with
``get_original_weight``: two int64 index tensors of ``numel / 2`` each, two dequantized halves, their
scaled copies and a stack, ~14 bytes of transients per weight element for a result of 2 (bf16). At 405B
one MLP weight has 872M elements: ~10 GiB of transients for one matmul, in forward, in the recomputed
forward and in backward (torchtune hides them by compiling: Triton fuses the dequantization).

:func:`nf4_linear` never holds the dense weight of a large matmul either (1.6 GiB in bf16 for that 405B MLP
weight, alive next to a gathered layer): it multiplies by tiles of at most ~``TILE_BYTES`` of dense weight,
row tiles in forward (``out[..., rows] = F.linear(x, W[rows])``) and column tiles in backward
(``grad_x[..., cols] = grad_y @ W[:, cols]``), each written into the preallocated result. Either way every
output element is still one dot product over the whole reduction dimension, so no sum is split or reordered:
the results equal the dense matmul's bit for bit wherever the GEMM's reduction order for an element does not
depend on the other dimension's extent (CPU's fp32 and bf16 GEMMs; the tests check it). Each tile is
dequantized ``CHUNK_ELEMENTS`` at a time, each chunk through a 256-entry byte -> (high, low) pair table
gathered with int32 indices: at most ~4 bytes per chunk element live besides the tile (64 MiB for bf16). The
values are torchao's, bit for bit: the same NF4 levels, the same double-quantized block scalers computed by
the same ops, the same product in the weight's dtype, then the same cast. A weight of at most ``TILE_BYTES``
(or whose rows are not whole quantization blocks) is dequantized whole by :func:`dequantize_nf4` and
multiplied as torchao does.

:class:`NF4Linear` is the ``nn.Linear`` whose ``forward`` calls it;
:func:`~lightning_plugins.adapters.qlora.quantize_base_to_nf4` gives each frozen linear it converts this
class. Like ``LinearNF4``, the autograd function saves only the NF4 weight (never the dense one) and gives
the input its gradient; the base is frozen. Under ``torch.compile`` the matmul goes to torchao's path, whose
dequantization Inductor fuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from torchao.quantization import NF4Tensor

__all__ = ["CHUNK_ELEMENTS", "TILE_BYTES", "NF4Linear", "dequantize_nf4", "dequantize_nf4_tile", "nf4_linear"]

#: Weight elements dequantized at once (rounded down to whole scaler groups): 16M elements keep a chunk's
#: transients at 64 MiB in bf16 (int32 indices and the gathered pairs), and a 405B MLP weight at 52 chunks.
CHUNK_ELEMENTS = 2**24

#: Dense bytes of one tile of a tiled matmul (rounded up to whole quantization blocks): a 405B MLP weight
#: (53248 x 16384, 1.6 GiB in bf16) in 7 tiles, each still a GEMM of thousands of rows or columns; a weight
#: of this size or less (every 8B one) is multiplied whole.
TILE_BYTES = 2**28


def _level_pairs(weight: NF4Tensor) -> Tensor:
    """The 16 levels in the weight's dtype, paired as a byte decodes: (level of the high nibble, of the low one)."""
    levels = weight.nf4
    return torch.stack((levels.repeat_interleave(16), levels.repeat(16)), dim=-1)


def _scale_into(target: Tensor, values: Tensor, scalers: Tensor, same_dtype: bool) -> None:
    """``target = values * scalers`` (one scaler per block, the last dimension): the product in the weight's
    dtype, then the cast to the target's, as torchao's ``get_original_weight().to(dtype)``."""
    if same_dtype:
        torch.mul(values, scalers.unsqueeze(-1), out=target)
    else:
        target.copy_(values * scalers.unsqueeze(-1))


def dequantize_nf4(weight: NF4Tensor, dtype: torch.dtype) -> Tensor:
    """``weight.to(dtype)`` as torchao computes it (bitwise), holding one chunk's transients at a time.

    Args:
        weight: A contiguous 2-D ``NF4Tensor`` (a module's weight, or FSDP2's unsharded one).
        dtype: The dtype of the dense result (the matmul's).
    """
    _check(weight)
    block, group = weight.block_size, weight.scaler_block_size
    group_elements = block * group
    numel = weight.numel()
    pairs = _level_pairs(weight)
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    flat = out.view(-1)
    step = max(CHUNK_ELEMENTS // group_elements, 1) * group_elements
    for start in range(0, numel, step):
        stop = min(start + step, numel)
        blocks = slice(start // block, stop // block)
        groups = slice(start // group_elements, stop // group_elements)
        # torchao's dequantize_scalers, on this chunk's groups: the same ops, so the same values.
        codes = weight.quantized_scalers[blocks].view(-1, group)
        scalers = (codes / weight.quantization_factor[groups].unsqueeze(-1)).flatten().to(weight.dtype)
        scalers = scalers + weight.scaler_mean
        values = pairs.index_select(0, weight.quantized_data[start // 2 : stop // 2].to(torch.int32))
        _scale_into(flat[start:stop].view(-1, block), values.view(-1, block), scalers, dtype == weight.dtype)
        del codes, scalers, values
    return out


def dequantize_nf4_tile(weight: NF4Tensor, dtype: torch.dtype, rows: slice, cols: slice) -> Tensor:
    """``weight.to(dtype)[rows, cols]`` (bitwise), without the rest of the dense weight.

    ``rows`` and ``cols`` are plain ranges (``start`` and ``stop`` set, no step); the columns must start and stop
    on quantization blocks, whole blocks per row: each element keeps its own block's scaler, computed by the
    ops torchao computes it with, one element at a time, so a tile's values are the whole weight's.
    """
    _check(weight)
    out_features, in_features = weight.shape
    block, group = weight.block_size, weight.scaler_block_size
    if in_features % block or cols.start % block or cols.stop % block:
        raise ValueError(
            f"dequantize_nf4_tile: columns {cols.start}:{cols.stop} of a weight of {in_features} columns are not"
            f" whole quantization blocks of {block}."
        )
    per_row, first, last = in_features // block, cols.start // block, cols.stop // block
    data = weight.quantized_data.view(out_features, in_features // 2)[:, cols.start // 2 : cols.stop // 2]
    codes = weight.quantized_scalers.view(out_features, per_row)[:, first:last]
    block_ids = torch.arange(first, last, device=weight.device)
    pairs = _level_pairs(weight)
    out = torch.empty(rows.stop - rows.start, cols.stop - cols.start, dtype=dtype, device=weight.device)
    tiles = out.view(out.shape[0], last - first, block)
    step = max(CHUNK_ELEMENTS // out.shape[1], 1)
    for start in range(rows.start, rows.stop, step):
        stop = min(start + step, rows.stop)
        row_ids = torch.arange(start, stop, device=weight.device).unsqueeze(-1)
        factors = weight.quantization_factor[(row_ids * per_row + block_ids) // group]
        scalers = (codes[start:stop] / factors).to(weight.dtype) + weight.scaler_mean
        values = pairs.index_select(0, data[start:stop].to(torch.int32).reshape(-1))
        target = tiles[start - rows.start : stop - rows.start]
        _scale_into(target, values.view(target.shape), scalers, dtype == weight.dtype)
        del factors, scalers, values
    return out


def _check(weight: NF4Tensor) -> None:
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"nf4_linear expects a contiguous 2-D NF4 weight (an nn.Linear's), got shape {tuple(weight.shape)} with"
            f" strides {weight.stride()}. Use torchao's `weight.to(dtype)` for a transposed or reshaped NF4 tensor."
        )
    group_elements = weight.block_size * weight.scaler_block_size
    if weight.numel() % group_elements:
        raise ValueError(
            f"nf4_linear: an NF4 weight of {weight.numel()} elements is not made of whole scaler groups of"
            f" {weight.scaler_block_size} blocks of {weight.block_size}: quantize with"
            " `to_nf4(w, block_size, scaler_block_size)` whose groups divide the weight."
        )


def _tiles(weight: NF4Tensor, dtype: torch.dtype, dim: int) -> list[slice] | None:
    """The row (``dim`` 0) or column (1) ranges of tiles of ~``TILE_BYTES`` each, whole quantization blocks
    (columns need them); ``None`` when the weight is multiplied whole (small enough, or rows that are not whole
    blocks)."""
    block = weight.block_size
    dense = weight.numel() * torch.empty((), dtype=dtype).element_size()
    if dense <= TILE_BYTES or weight.shape[1] % block:
        return None
    length = weight.shape[dim]
    extent = -(-length // -(-dense // TILE_BYTES))  # even tiles
    extent = -(-extent // block) * block
    tiles = [slice(start, min(start + extent, length)) for start in range(0, length, extent)]
    if len(tiles) > 1 and tiles[-1].stop - tiles[-1].start < block:
        # No sliver of a few rows: a GEMM that narrow may take another kernel, summing in another order (CPU's
        # fp32 GEMM below 12 rows).
        tiles[-2:] = [slice(tiles[-2].start, length)]
    return tiles


class _LinearNF4(torch.autograd.Function):
    """torchao's ``LinearNF4`` over tiles of the dequantized weight: saves the NF4 weight only; the weight gets
    no gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, input: Tensor, weight: NF4Tensor) -> Tensor:
        ctx.save_for_backward(weight)
        tiles = _tiles(weight, input.dtype, 0)
        if tiles is None:
            return F.linear(input, dequantize_nf4(weight, input.dtype))
        out_features, in_features = weight.shape
        out = input.new_empty(*input.shape[:-1], out_features)
        for rows in tiles:
            out[..., rows] = F.linear(input, dequantize_nf4_tile(weight, input.dtype, rows, slice(0, in_features)))
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor) -> tuple[Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        (weight,) = ctx.saved_tensors
        dtype = grad_output.dtype
        tiles = _tiles(weight, dtype, 1)
        if tiles is None:
            return grad_output @ dequantize_nf4(weight, dtype), None
        out_features, in_features = weight.shape
        grad_input = grad_output.new_empty(*grad_output.shape[:-1], in_features)
        for cols in tiles:
            grad_input[..., cols] = grad_output @ dequantize_nf4_tile(weight, dtype, slice(0, out_features), cols)
        return grad_input, None


def nf4_linear(input: Tensor, weight: NF4Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(input, weight, bias)`` for an NF4 weight, equal bit for bit to torchao's on CPU, with neither the
    dense weight of a large matmul nor torchao's transients.

    The bias is added after the matmul, as torchao does.
    """
    if torch.compiler.is_compiling():
        return F.linear(input, weight, bias)  # torchao's LinearNF4: Inductor fuses its dequantization
    out = _LinearNF4.apply(input, weight)
    return out if bias is None else out + bias


class NF4Linear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight is an ``NF4Tensor``, multiplied through :func:`nf4_linear`.

    :func:`~lightning_plugins.adapters.qlora.quantize_base_to_nf4` sets it as the class of each linear it
    quantizes (in place, so peft's LoRA layer, hooks and parameter names are unchanged).
    """

    def forward(self, input: Tensor) -> Tensor:
        return nf4_linear(input, self.weight, self.bias)
