"""The transformers model a layout applies to, inside or around a peft ``PeftModel``.

Both the engine (``parallelize`` a ``PeftModel``; the collective ``save_pretrained``) and the adapters
(:mod:`lightning_plugins.adapters.lora`) ask this; it lives in the engine, which the adapters import.
"""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["hf_model_of", "peft_model_around"]


def hf_model_of(model: nn.Module) -> nn.Module:
    """The transformers model a layout applies to: the one inside a ``PeftModel``, else ``model`` itself.

    For LoRA that is ``peft_model.base_model.model``, the model holding the LoRA layers; it is also the
    outermost ``transformers.PreTrainedModel``, which the Lightning strategies find.
    """
    peft = sys.modules.get("peft")  # a model cannot be a PeftModel unless peft was imported
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def peft_model_around(module: nn.Module, model: nn.Module) -> nn.Module:
    """The peft ``PeftModel`` inside ``module`` (or ``module`` itself) that wraps the transformers ``model``, else
    ``model``: what a door hands to ``parallelize``, so that the ``PeftModel``'s ``save_pretrained`` is collective
    too."""
    peft = sys.modules.get("peft")
    if peft is None:
        return model
    return next((m for m in module.modules() if isinstance(m, peft.PeftModel) and hf_model_of(m) is model), model)
