"""Memory-efficient RMSNorm: the model's own norm, computed the same way, saving only its input and ``rstd``.

transformers' RMSNorms upcast their input to fp32 and run ``pow``/``mean``/``rsqrt``/``mul`` under autograd,
which keeps several fp32 copies of the activation per norm for backward (the fp32 input, its normalised
value, and in Llama's form the down-cast result). :class:`_RMSNormFunction` runs the same operations, in the
same order, with autograd off, saves the input in its own dtype and the fp32 ``rstd`` (one value per row),
and in backward recomputes the rest and applies the very formulas autograd would (``derivatives.yaml``), so
forward and backward are bit-identical to the original in fp32 and bf16.

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
from typing import Any

import torch
from torch import nn

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
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.form = form
        return _scale(xf * rstd, weight, form, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        # autograd's formulas, in its order, so the values are bit-identical; computed with few full-size fp32
        # temporaries at once (the normalised activation only for the weight's gradient, then freed; products in
        # place on tensors made here; the variance term per row, broadcast): the norm's backward is a layer's
        # backward peak once the MLP is tiled.
        x, weight, rstd = ctx.saved_tensors
        xf = x.to(torch.float32)
        grad_weight = None
        if ctx.form == "llama":  # out = weight * h, h = hf.to(dtype)
            if ctx.needs_input_grad[1]:
                h = (xf * rstd).to(x.dtype)
                grad_weight = (grad * h).sum_to_size(weight.shape).to(weight.dtype)
                del h
            grad_hf = (grad * weight).to(x.dtype).to(torch.float32)
        else:  # olmo2: out = (weight * hf).to(dtype); gemma: out = (hf * (1 + weight.float())).to(dtype)
            gemma = ctx.form == "gemma"
            g32 = grad.to(torch.float32 if gemma else torch.promote_types(weight.dtype, torch.float32))
            scale = 1.0 + weight.float() if gemma else weight
            if ctx.needs_input_grad[1]:
                hf = xf * rstd
                grad_weight = (g32 * hf if gemma else hf * g32).sum_to_size(weight.shape).to(weight.dtype)
                del hf
            grad_hf = (g32 * scale).to(torch.float32)
            del g32
        # hf = xf * rstd; rstd = rsqrt(mean(xf ** 2) + eps). grad_hf is this function's own tensor; xf is too unless
        # x was fp32 already. Products commute bit for bit, and dividing the row's term before broadcasting it gives
        # each element the value dividing the broadcast gives.
        grad_rstd = (grad_hf * xf).sum(-1, keepdim=True)
        grad_var = -0.5 * grad_rstd * rstd.pow(3)
        grad_sq = grad_var / xf.shape[-1]
        grad_x = grad_hf.mul_(rstd)
        two_x = xf.mul_(2.0) if xf is not x else 2.0 * xf
        grad_x.add_(two_x.mul_(grad_sq))
        return grad_x.to(x.dtype), grad_weight, None, None
