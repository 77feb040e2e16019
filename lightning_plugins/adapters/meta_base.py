"""LoRA adapters on a base model that lives on the meta device: the adapters real, the base read later, per rank.

peft builds each adapter on the device of the weight it adapts, so on a meta-device model it builds meta adapters,
which nothing can fill (a checkpoint of the base holds no adapter). :func:`real_adapters_on_meta_base` gives peft a
stand-in for every meta parameter while it wraps the model: a CPU tensor of the parameter's shape and dtype that holds
one element (a zero broadcast with stride 0), so peft draws and initializes each adapter on the CPU, in the base's
dtype, from the global random state, exactly as it does on a model with real weights, and then every stand-in goes
back to the meta device. The base is then parallelized and each rank reads its slices of the checkpoint
(:func:`lightning_plugins.checkpoint.load.load_sharded_safetensors`); the adapters are distributed from their real
values, so every layout starts from the adapters one process would build.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["ADAPTER_NAME", "real_adapters_on_meta_base"]

#: The names of peft's adapter tensors (``q_proj.lora_A.default.weight``, ...).
ADAPTER_NAME = re.compile(r"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.")


@contextmanager
def real_adapters_on_meta_base(model: nn.Module) -> Iterator[None]:
    """While peft wraps ``model``, its meta parameters are one-element CPU stand-ins; after, they are meta again.

    Parameters peft adds (the adapters) are real; copies peft makes of the base (``modules_to_save``) go back to the
    meta device with the base, to be read from the checkpoint like it.
    """
    zeros: dict[torch.dtype, torch.Tensor] = {}
    real = {id(param) for param in model.parameters() if not param.is_meta}

    def stand_in(name: str, param: nn.Parameter) -> torch.Tensor | None:
        if not param.is_meta or param.dim() == 0:
            return None
        zero = zeros.setdefault(param.dtype, torch.zeros((), dtype=param.dtype, device="cpu"))
        return zero.expand(param.shape)

    _swap(model, stand_in)
    try:
        yield
    finally:

        def back(name: str, param: nn.Parameter) -> torch.Tensor | None:
            if id(param) in real or ADAPTER_NAME.search(name) or param.is_meta:
                return None
            return torch.empty_like(param, device="meta")

        _swap(model, back)


def _swap(model: nn.Module, new: Callable[[str, nn.Parameter], torch.Tensor | None]) -> None:
    """Replace each parameter ``p`` named ``name`` of ``model`` by ``new(name, p)`` (same ``requires_grad``; ``None``
    keeps ``p``), keeping shared ones shared."""
    done: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                tensor = new(f"{module_name}.{name}", param)
                done[id(param)] = param if tensor is None else nn.Parameter(tensor, param.requires_grad)
            module._parameters[name] = done[id(param)]
