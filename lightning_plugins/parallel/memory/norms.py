"""Memory-efficient RMSNorm: the model's own norm, computed the same way, saving only its input and ``rstd``.

transformers' RMSNorms upcast their input to fp32 and run ``pow``/``mean``/``rsqrt``/``mul`` under autograd,
which keeps several fp32 copies of the activation per norm for backward (the fp32 input, its normalised
value, and in Llama's form the down-cast result). :class:`_RMSNormFunction` runs the same operations, in the
same order, with autograd off, saves the input in its own dtype and the fp32 ``rstd`` (one value per row),
and in backward recomputes the rest and applies the very formulas autograd would (``derivatives.yaml``), so
forward and backward are bit-identical to the original in fp32 and bf16. Every op but the weight's gradient is
row-local, so forward and the input's gradient run on blocks of rows (:data:`_BLOCK_ELEMENTS`, 16 MiB per fp32
temporary): their fp32 temporaries (the upcast input, the normalised value, the products) are one block's, not
up to three fp32 copies of the whole activation (a layer's peak once its MLP is tiled; several GiB at long
context). The weight's gradient (one sum over all rows, as autograd's) is computed whole, only when the weight
trains. DTensors (below) are not cut into blocks: a slice of a sharded tensor would redistribute it.

A norm is swapped by its forward contract, not its class name: a module whose ``forward`` source is one of
the three forms transformers ships (:data:`_FORMS`: Llama's ``weight * x.to(dtype)``, OLMo 2's
``(weight * x).to(dtype)``, Gemma's ``x * (1 + weight)`` in fp32) gets :func:`efficient_rms_norm` as its
forward; any other norm keeps its own. Under tensor/sequence parallelism the function runs on DTensors
(a ``Shard(1)`` residual stream, ``Shard(2)`` q/k-norm heads): every op is row-local, and the weight's
gradient comes out ``Partial`` as autograd's would.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_LLAMA = '''
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
'''
_OLMO2 = '''
def forward(self, hidden_states) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)
'''
_GEMMA = '''
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
'''
_GEMMA_NORM = '''
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
'''

#: Normalised forward source -> (form, name of the epsilon attribute).
_FORMS: dict[str, tuple[str, str]] = {
    _LLAMA.strip(): ("llama", "variance_epsilon"),
    _OLMO2.strip(): ("olmo2", "variance_epsilon"),
    _GEMMA.strip(): ("gemma", "eps"),
}


def method_source(function: Any) -> str | None:
    """A method's source, dedented, without comments, blank lines and trailing remarks; ``None`` if unreadable."""
    try:
        text = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    lines = (line.split("  #")[0].rstrip() for line in text.splitlines())
    return "\n".join(line for line in lines if line and not line.lstrip().startswith("#"))


def norm_form(module: nn.Module) -> tuple[str, str] | None:
    """``(form, epsilon attribute)`` when ``module`` is an RMSNorm this module can compute, else ``None``."""
    if not isinstance(getattr(module, "weight", None), torch.Tensor) or any(True for _ in module.children()):
        return None
    form = _FORMS.get(method_source(type(module).forward) or "")
    if form is None or not isinstance(getattr(module, form[1], None), float):
        return None
    if form[0] == "gemma" and method_source(getattr(type(module), "_norm", None)) != _GEMMA_NORM.strip():
        return None
    return form


def use_efficient_norms(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` whose form is known the memory-efficient forward; return how many.

    The swap is per instance (``module.forward``); hooks (sequence parallelism's, FSDP2's) are untouched.
    """
    count = 0
    for module in model.modules():
        form = norm_form(module)
        if form is not None and not isinstance(module.forward, _EfficientForward):
            module.forward = _EfficientForward(module, *form)  # type: ignore[method-assign]
            count += 1
    return count


class _EfficientForward:
    """A norm's forward through :class:`_RMSNormFunction` (a callable object: recognisable, and picklable state)."""

    def __init__(self, module: nn.Module, form: str, eps_attr: str) -> None:
        self.module, self.form, self.eps_attr = module, form, eps_attr

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return efficient_rms_norm(hidden_states, self.module.weight, getattr(self.module, self.eps_attr), self.form)


def efficient_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str = "llama") -> torch.Tensor:
    """RMSNorm of ``x`` in one of transformers' forms (``"llama"``, ``"olmo2"``, ``"gemma"``), saving ``x`` and ``rstd``."""
    return _RMSNormFunction.apply(x, weight, eps, form)


def _scale(hf: torch.Tensor, weight: torch.Tensor, form: str, dtype: torch.dtype) -> torch.Tensor:
    """The forward after normalisation, exactly as the model's own norm writes it."""
    if form == "llama":
        return weight * hf.to(dtype)
    if form == "olmo2":
        return (weight * hf).to(dtype)
    return (hf * (1.0 + weight.float())).to(dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> torch.Tensor:
        ctx.form = form
        rows = _rows_per_block(x, weight)
        if rows is None:
            out, rstd = _normalise(x, weight, eps, form)
        else:
            dtype = torch.promote_types(weight.dtype, x.dtype) if form == "llama" else x.dtype  # as _scale's
            out = x.new_empty(x.shape, dtype=dtype)
            rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
            for x_rows, out_rows, rstd_rows in _row_blocks(rows, x, out, rstd):
                out_rows[:], rstd_rows[:] = _normalise(x_rows, weight, eps, form)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        # autograd's formulas, in its order, so the values are bit-identical, with few full-size fp32 temporaries at
        # once: the weight's gradient first (the normalised activation made for it, then freed), then the input's,
        # a block of rows at a time (every op is row-local), so its fp32 temporaries are one block's.
        x, weight, rstd = ctx.saved_tensors
        grad_weight = _weight_grad(grad, x, weight, rstd, ctx.form) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None, None
        rows = _rows_per_block(x, weight)
        if rows is None:
            return _input_grad(grad, x, weight, rstd, ctx.form), grad_weight, None, None
        grad_x = x.new_empty(x.shape)
        for out, grad_rows, x_rows, rstd_rows in _row_blocks(rows, grad_x, grad, x, rstd):
            out[:] = _input_grad(grad_rows, x_rows, weight, rstd_rows, ctx.form)
        return grad_x, grad_weight, None, None


#: Elements of a block of rows (4M: 16 MiB per fp32 temporary, 1024 rows of width 4096): large enough that each
#: kernel still moves 16 MB or more, so that a block's launches do not outlast its work on a GPU.
_BLOCK_ELEMENTS = 1 << 22


def _rows_per_block(x: torch.Tensor, weight: torch.Tensor) -> int | None:
    """Rows of ``x`` per block, or ``None`` when one block holds them all or a tensor is a DTensor."""
    rows = max(1, _BLOCK_ELEMENTS // x.shape[-1])
    if isinstance(x, DTensor) or isinstance(weight, DTensor) or x.numel() <= rows * x.shape[-1]:
        return None
    return rows


def _row_blocks(rows: int, *tensors: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    """The same block of ``rows`` rows of each tensor (flattened to ``[rows, last dim]``), block after block."""
    flat = [t.reshape(-1, t.shape[-1]) for t in tensors]
    for start in range(0, flat[0].shape[0], rows):
        yield [t[start : start + rows] for t in flat]


def _normalise(x: torch.Tensor, weight: torch.Tensor, eps: float, form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm's output and ``rstd`` for the rows of ``x``, in the model's own operations."""
    xf = x.to(torch.float32)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _scale(xf * rstd, weight, form, x.dtype), rstd


def _weight_grad(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, form: str
) -> torch.Tensor:
    """The weight's gradient, as autograd computes it for ``form`` (over all rows at once: one sum, autograd's)."""
    hf = x.to(torch.float32) * rstd
    if form == "llama":  # out = weight * h, h = hf.to(dtype)
        product = grad * hf.to(x.dtype)
    elif form == "gemma":  # out = (hf * (1 + weight.float())).to(dtype)
        product = grad.to(torch.float32) * hf
    else:  # olmo2: out = (weight * hf).to(dtype)
        product = hf * grad.to(torch.promote_types(weight.dtype, torch.float32))
    del hf
    return product.sum_to_size(weight.shape).to(weight.dtype)


def _input_grad(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, form: str
) -> torch.Tensor:
    """The input's gradient, as autograd computes it for ``form``, for the rows of ``x`` given (row-local)."""
    xf = x.to(torch.float32)
    if form == "llama":
        grad_hf = (grad * weight).to(x.dtype).to(torch.float32)
    elif form == "gemma":
        grad_hf = (grad.to(torch.float32) * (1.0 + weight.float())).to(torch.float32)
    else:
        grad_hf = (grad.to(torch.promote_types(weight.dtype, torch.float32)) * weight).to(torch.float32)
    # hf = xf * rstd; rstd = rsqrt(mean(xf ** 2) + eps). grad_hf is this function's own tensor; xf is too unless
    # x was fp32 already. Products commute bit for bit, and dividing the row's term before broadcasting it gives
    # each element the value dividing the broadcast gives.
    grad_rstd = (grad_hf * xf).sum(-1, keepdim=True)
    grad_var = -0.5 * grad_rstd * rstd.pow(3)
    grad_sq = grad_var / xf.shape[-1]
    grad_x = grad_hf.mul_(rstd)
    two_x = xf.mul_(2.0) if xf is not x else 2.0 * xf
    grad_x.add_(two_x.mul_(grad_sq))
    return grad_x.to(x.dtype)
