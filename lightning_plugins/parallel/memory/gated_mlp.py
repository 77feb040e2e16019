"""Memory-efficient gated MLP (SwiGLU, GeGLU): the model's own MLP, computed the same way, saving one tensor less.

transformers' gated MLPs compute ``down_proj(act_fn(gate) * up)``. Under autograd that keeps four
intermediate-width tensors per layer for backward: ``gate`` (the activation's backward), ``act_fn(gate)`` and
``up`` (the product's backward) and the product (``down_proj``'s input). :class:`_GatedProduct` computes
``act_fn(gate) * up`` with autograd off, saves ``gate`` and ``up`` only, and in backward recomputes
``act_fn(gate)`` and applies the very kernels autograd would (the product's formula, then ``silu_backward`` or
``gelu_backward``), so forward and backward are bit-identical to the model's MLP in fp32 and bf16: one
intermediate-width tensor less per layer (Llama-3.1-8B at 8K tokens in bf16: 224 MiB a layer, 7 of the 41 bytes
per token and hidden unit a layer keeps), for one elementwise activation more in backward.

An MLP is swapped by its forward contract, not its class name: a module whose ``forward`` source is one of the two
forms transformers ships (:data:`_FORMS`: Llama's ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, used by most
decoder families, and Phi-3's fused ``gate_up_proj`` chunked in two) and whose activation is SiLU or GELU (exact or
tanh, as torch computes them: :data:`_ACTIVATIONS`) gets :class:`_EfficientForward`; any other MLP keeps its own.
The activation is computed by its torch function, not called as a module (no module call in backward, which
torch.compile could not trace and module trackers would not expect). The projections are still called as modules,
so what wraps them (LoRA adapters, tensor-parallel hooks, float8 or NF4 linears) acts as before; under tensor
parallelism ``gate`` and ``up`` are the column shards each rank holds, and the product is elementwise. A mixture of
experts' fused experts module (transformers' ``use_experts_implementation``) whose gate is transformers' default
``act_fn(gate) * up`` gets the same product as its ``_apply_gate``, whichever path (:mod:`.experts`' grouped GEMMs
or transformers' own) runs the experts.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation, GELUTanh, SiLUActivation
from transformers.integrations.moe import _default_apply_gate

from lightning_plugins.parallel.memory.norms import method_source

_LLAMA = '''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
'''
_PHI3 = '''
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    up_states = self.gate_up_proj(hidden_states)
    gate, up_states = up_states.chunk(2, dim=-1)
    up_states = up_states * self.activation_fn(gate)
    return self.down_proj(up_states)
'''

#: Normalised forward source -> (form, name of the activation attribute).
_FORMS: dict[str, tuple[str, str]] = {
    _LLAMA.strip(): ("llama", "act_fn"),
    _PHI3.strip(): ("phi3", "activation_fn"),
}
#: A fused experts module's gate (``_apply_gate``) of transformers' default form.
_EXPERTS = ("experts", "act_fn")


def activation_kind(act: object) -> str | None:
    """The key of :data:`_ACTIVATIONS` that computes ``act`` exactly as its own forward does, else ``None``."""
    if isinstance(act, (nn.SiLU, SiLUActivation)):
        return "silu"
    if isinstance(act, nn.GELU):
        return f"gelu_{act.approximate}"
    if isinstance(act, GELUTanh) and isinstance(act.act, partial) and act.act.func is F.gelu:
        return "gelu_tanh"
    if isinstance(act, GELUActivation) and act.act is F.gelu:
        return "gelu_none"
    return None


def mlp_form(module: nn.Module) -> tuple[str, str] | None:
    """``(form, activation attribute)`` when ``module`` is a gated MLP this module can compute, else ``None``."""
    form = _FORMS.get(method_source(type(module).forward) or "")
    if form is None and getattr(type(module), "_apply_gate", None) is _default_apply_gate:
        form = _EXPERTS
    if form is None or activation_kind(getattr(module, form[1], None)) is None:
        return None
    return form


def use_efficient_mlps(model: nn.Module) -> int:
    """Give every gated MLP of ``model`` whose form is known the memory-efficient forward; return how many.

    The swap is per instance (``module.forward``, an experts module's ``_apply_gate``); hooks (FSDP2's, activation
    checkpointing's) are untouched.
    """
    count = 0
    for module in model.modules():
        form = mlp_form(module)
        method = "_apply_gate" if form == _EXPERTS else "forward"
        if form is not None and not isinstance(getattr(module, method), _EfficientForward):
            setattr(module, method, _EfficientForward(module, *form))
            count += 1
    return count


class _EfficientForward:
    """An MLP's forward through :class:`_GatedProduct` (a callable object: recognisable, and picklable state)."""

    def __init__(self, module: nn.Module, form: str, act_attr: str) -> None:
        self.module, self.form, self.act_attr = module, form, act_attr

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        act = activation_kind(getattr(module, self.act_attr))
        if self.form == "experts":  # ``_apply_gate(gate_up)``: the experts' fused projection's output, gate first
            return gated_product(*x.chunk(2, dim=-1), act)
        if self.form == "llama":
            gate, up = module.gate_proj(x), module.up_proj(x)
        else:  # phi3: one fused projection, gate first
            gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
        return module.down_proj(gated_product(gate, up, act))


def gated_product(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``activation`` a key of :data:`_ACTIVATIONS`, saving ``gate`` and ``up`` for backward."""
    return _GatedProduct.apply(gate, up, activation)


#: Activation -> (its forward, its backward ``(grad of the output, input) -> grad of the input``): the functions
#: autograd runs for ``F.silu`` and ``F.gelu`` (``derivatives.yaml``).
_ACTIVATIONS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "silu": (F.silu, torch.ops.aten.silu_backward),
    "gelu_none": (F.gelu, partial(torch.ops.aten.gelu_backward, approximate="none")),
    "gelu_tanh": (partial(F.gelu, approximate="tanh"), partial(torch.ops.aten.gelu_backward, approximate="tanh")),
}


class _GatedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return _ACTIVATIONS[activation][0](gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        gate, up = ctx.saved_tensors
        forward, backward = _ACTIVATIONS[ctx.activation]
        # The product's backward as autograd computes it (multiplication commutes bit for bit, so Phi-3's
        # ``up * act(gate)`` gets the same values), then the activation's own backward kernel.
        grad_up = grad * forward(gate) if ctx.needs_input_grad[1] else None
        grad_gate = backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, None
