"""A lean NF4 linear: the QLoRA base's matmul with the dequantization's transients bounded.

torchao's ``NF4Tensor`` routes ``F.linear`` to ``LinearNF4``, which dequantizes the whole weight with
``get_original_weight``: two int64 index tensors of ``numel / 2`` each, two dequantized halves, their
scaled copies and a stack, ~14 bytes of transients per weight element for a result of 2 (bf16). At 405B
one MLP weight has 872M elements: ~10 GiB of transients for one matmul, in forward, in the recomputed
forward and in backward (torchtune hides them by compiling: Triton fuses the dequantization).

:func:`nf4_linear` dequantizes into one preallocated weight of the input's dtype, ``CHUNK_ELEMENTS`` at a
time, each chunk through a 256-entry byte -> (high, low) pair table gathered with int32 indices: at most
~4 bytes per chunk element live besides the result (64 MiB for bf16), however large the weight. The values
are torchao's, bit for bit: the same NF4 levels, the same double-quantized block scalers computed by the
same ops, the same product in the weight's dtype, then the same cast and the same ``F.linear`` / ``@``.

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

__all__ = ["CHUNK_ELEMENTS", "NF4Linear", "dequantize_nf4", "nf4_linear"]

#: Weight elements dequantized at once (rounded down to whole scaler groups): 16M elements keep a chunk's
#: transients at 64 MiB in bf16 (int32 indices and the gathered pairs), and a 405B MLP weight at 52 chunks.
CHUNK_ELEMENTS = 2**24


def dequantize_nf4(weight: NF4Tensor, dtype: torch.dtype) -> Tensor:
    """``weight.to(dtype)`` as torchao computes it (bitwise), holding one chunk's transients at a time.

    Args:
        weight: A contiguous 2-D ``NF4Tensor`` (a module's weight, or FSDP2's unsharded one).
        dtype: The dtype of the dense result (the matmul's).
    """
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"nf4_linear expects a contiguous 2-D NF4 weight (an nn.Linear's), got shape {tuple(weight.shape)} with"
            f" strides {weight.stride()}. Use torchao's `weight.to(dtype)` for a transposed or reshaped NF4 tensor."
        )
    block, group = weight.block_size, weight.scaler_block_size
    group_elements = block * group
    numel = weight.numel()
    if numel % group_elements:
        raise ValueError(
            f"nf4_linear: an NF4 weight of {numel} elements is not made of whole scaler groups of {group} blocks of"
            f" {block}: quantize with `to_nf4(w, block_size, scaler_block_size)` whose groups divide the weight."
        )
    # The 16 levels in the weight's dtype, paired as a byte decodes: (level of the high nibble, of the low one).
    levels = weight.nf4
    pairs = torch.stack((levels.repeat_interleave(16), levels.repeat(16)), dim=-1)
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
        values = values.view(-1, block)
        target = flat[start:stop].view(-1, block)
        if dtype == weight.dtype:
            torch.mul(values, scalers.unsqueeze(-1), out=target)
        else:  # the product in the weight's dtype, then cast, as torchao's `get_original_weight().to(dtype)`
            target.copy_(values * scalers.unsqueeze(-1))
        del codes, scalers, values
    return out


class _LinearNF4(torch.autograd.Function):
    """torchao's ``LinearNF4`` with :func:`dequantize_nf4`: saves the NF4 weight only; the weight gets no gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, input: Tensor, weight: NF4Tensor) -> Tensor:
        ctx.save_for_backward(weight)
        return F.linear(input, dequantize_nf4(weight, input.dtype))

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor) -> tuple[Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        (weight,) = ctx.saved_tensors
        return grad_output @ dequantize_nf4(weight, grad_output.dtype), None


def nf4_linear(input: Tensor, weight: NF4Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(input, weight, bias)`` for an NF4 weight, equal bit for bit to torchao's, with lean transients.

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
