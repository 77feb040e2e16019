"""LoRA on the routed experts: peft's ``ParamWrapper`` adapters (``LoraConfig(target_parameters=[...])``) run inside
the engine's grouped experts forward, under every layout.

peft adapts a fused 3-D expert weight (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) with one wrapper per
parameter, nested around the experts module. Its own forward adds the delta ``scaling * lhs @ rhs`` (one low-rank
pair per expert, :meth:`ParamWrapper.get_delta_factors`) through a ``torch.nn.utils.parametrize`` parametrization for
the duration of the call. That cannot hold under the engine: FSDP2 swaps the experts' parameters itself, and under
expert parallelism a rank holds only its experts while the adapters hold all of them.

So :func:`bind_expert_adapters` turns each wrapper's forward into a pass-through to the module it wraps and lets the
experts forward read the adapted weight with :func:`adapted_weight`: this rank's experts' slice of the base weight
plus the same experts' slice of each active adapter's delta. The adapters stay where peft put them (the state dict,
``save_pretrained`` and the export keep peft's names), dense like any LoRA weight:

* FSDP2 shards them with their decoder layer; they are gathered for the layer's forward.
* Expert parallelism: a rank multiplies only its experts' factors, so their gradient is zero for the other experts;
  FSDP2's average over all data ranks then sums each expert's gradient over the ranks that hold it, divided by the
  data ranks, which is the experts' own gradient scale. (``lora_B`` is stored ``[out, rank x experts]`` with the
  expert innermost, so it has no contiguous per-expert split to ``Shard`` over ``ep``; the slice is taken per call.)
* Tensor parallelism: the mixture-of-experts block runs on each rank's tokens, its adapters replicated like its
  weights (:class:`lightning_plugins.parallel.moe.experts.TokenLocalBlock`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from lightning_plugins.errors import LayoutError

__all__ = ["adapted_weight", "bind_expert_adapters", "is_expert_adapter"]


def is_expert_adapter(module: nn.Module) -> bool:
    """Whether ``module`` is a peft ``ParamWrapper`` on a 3-D weight (experts ``[experts, out, in]``): a LoRA adapter
    on an experts module."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora.layer import ParamWrapper

    return isinstance(module, ParamWrapper) and module.get_param().dim() == 3


def bind_expert_adapters(block: nn.Module, experts: nn.Module) -> None:
    """Let ``experts`` (an experts module inside ``block``) apply the peft adapters wrapped around it itself.

    Raises:
        LayoutError: for an adapter with a ``lora_B`` bias (``LoraConfig(lora_bias=True)``), which has no per-expert
            form.
    """
    adapters: dict[str, list[nn.Module]] = {}
    for name, module in block.named_modules():
        if not is_expert_adapter(module) or module.get_base_layer() is not experts:
            continue
        biased = sorted(adapter for adapter, bias in module.lora_bias.items() if bias)
        if biased:
            raise LayoutError(
                f"{name} (LoRA on {module.parameter_name}) has a lora_B bias for adapters {biased}; LoRA on expert"
                " weights trains without one here. Leave lora_bias off in the LoraConfig."
            )
        adapters.setdefault(module.parameter_name, []).append(module)
        module.forward = _PassThrough(module)  # type: ignore[method-assign]
    if adapters:
        experts._lp_lora = adapters


def adapted_weight(experts: nn.Module, name: str) -> Tensor:
    """The experts module's weight ``name`` for the experts this rank computes, with its LoRA deltas added.

    Under expert parallelism the module's weight is this rank's experts (from ``experts._lp_first_expert`` on).
    """
    weight = getattr(experts, name)
    wrappers = getattr(experts, "_lp_lora", {}).get(name, ())
    first = getattr(experts, "_lp_first_expert", 0)
    local = slice(first, first + weight.shape[0])
    for wrapper in wrappers:
        if wrapper.disable_adapters or wrapper.merged:
            continue
        for adapter in wrapper.active_adapters:
            if adapter in wrapper.lora_A:
                lhs, rhs, scaling = wrapper.get_delta_factors(adapter)
                weight = torch.baddbmm(weight, lhs[local].to(weight.dtype), rhs[local].to(weight.dtype), alpha=scaling)
    return weight


class _PassThrough:
    """A ``ParamWrapper``'s forward once bound: the wrapped module's (the experts forward adds the delta)."""

    def __init__(self, wrapper: nn.Module) -> None:
        self.wrapper = wrapper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper.base_layer(*args, **kwargs)
