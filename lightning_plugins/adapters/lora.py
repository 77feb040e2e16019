"""LoRA through peft: the recipe's ``lora:`` settings, wrapping a model, and finding what a peft model trains.

The API is the one LoRA users already write: ``peft.get_peft_model(model, LoraConfig(...))`` (or
:func:`apply_lora` with a :class:`LoraOptions`), then :func:`lightning_plugins.parallelize` on the result
(or on the transformers model inside it, which is what the Lightning strategies find). Each layout places
the adapters with their base layer:

* tensor parallelism splits each adapter half consistently with its base layer
  (:mod:`lightning_plugins.parallel.tensor`);
* FSDP2 shards the frozen base like any parameter; it gets no gradient, and an optimizer built over
  :func:`trainable_parameters` holds no state for it;
* pipeline stages keep the adapters of their own layers; context parallelism needs nothing more.

Order matters, and the wrong orders are silently wrong: LoRA first, then ``parallelize`` (peft wrapping
tensor-parallel or FSDP2-sharded linears would build adapters of the local size, or leave them unsynchronised).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_plugins.adapters.meta_base import real_adapters_on_meta_base
from lightning_plugins.parallel.families import family_for, projection_names
from lightning_plugins.parallel.image_text import image_text_parts
from lightning_plugins.errors import LayoutError, OptionsError

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = [
    "PEFT_PREFIX",
    "LoraOptions",
    "apply_lora",
    "check_lora_targets",
    "lora_layers",
    "trainable_parameters",
]

#: peft's key prefix for the transformers model inside a ``PeftModel`` (``base_model.model.<name>``).
PEFT_PREFIX = "base_model.model."

QUANTIZE = ("none", "nf4")


@dataclass(frozen=True)
class LoraOptions:
    """LoRA settings: the recipe's ``lora:`` section and what :func:`apply_lora` takes."""

    r: int = 16
    """Rank of each adapter (``lora_A``: ``r x in``, ``lora_B``: ``out x r``)."""
    alpha: float = 32
    """Scale numerator: the adapter's output is multiplied by ``alpha / r`` (``alpha / sqrt(r)`` with
    ``use_rslora``)."""
    dropout: float = 0.0
    """Dropout on each adapter's input (0 disables it)."""
    target_modules: tuple[str, ...] | None = None
    """Module names (last name component, e.g. ``"q_proj"``) to adapt; ``None`` takes the model family's attention and
    MLP projections (``q/k/v/o_proj``, ``gate/up/down_proj`` for Llama, Mistral, Qwen). Under tensor parallelism only
    those projections can be adapted."""
    use_rslora: bool = False
    """Rank-stabilised scaling ``alpha / sqrt(r)`` (Kalajdzievski 2023)."""
    quantize: Literal["none", "nf4"] = "none"
    """``"nf4"`` stores the frozen base as 4-bit NF4 (QLoRA, see :mod:`lightning_plugins.adapters.qlora`); ``"none"``
    keeps it dense."""
    target_parameters: tuple[str, ...] | None = None
    """Parameter names (peft's ``target_parameters``: the full name or its last components) adapted with LoRA directly:
    a mixture of experts' fused 3-D weights, e.g. ``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`` (one
    low-rank pair per expert, run by the engine's grouped experts forward under every layout,
    :mod:`lightning_plugins.parallel.moe.expert_adapters`)."""
    modules_to_save: tuple[str, ...] | None = None
    """Module names (peft's ``modules_to_save``: names the module's full name ends with) trained in full next to the
    adapters and saved with them, e.g. a mixture of experts' router: ``["gate"]`` (Mixtral, Qwen-MoE) or ``["router"]``
    (gpt-oss). Under tensor parallelism only modules inside a mixture-of-experts block can be (the block runs whole on
    each rank's tokens)."""
    autocast_adapter_dtype: bool = True
    """peft's ``get_peft_model(..., autocast_adapter_dtype=...)``, under peft's name. ``True`` (peft's default) upcasts
    the adapters of a bf16/fp16 base to fp32: each adapted projection then casts its input to fp32 and keeps that copy
    for backward, and the adapters' gradients and AdamW state are fp32. ``False`` keeps the adapters in the base's dtype
    (bf16 adapters next to a bf16 base, as torchtune trains them; with ``quantize: nf4`` the adapters stay in the dtype
    the base had before quantization). It changes nothing for an fp32 base, so nothing under FSDP2 mixed precision with
    fp32 master weights (``model.dtype: fp32``, ``memory.param_dtype: bf16``): the adapters are fp32 already and FSDP2
    casts them for compute."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise OptionsError(f"lora r={self.r!r} must be a positive integer (the adapter rank, e.g. 8, 16 or 64).")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise OptionsError(
                f"lora alpha={self.alpha!r} must be a positive number (commonly 2 x r, e.g. alpha=32 for r=16)."
            )
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise OptionsError(f"lora dropout={self.dropout!r} must be in [0, 1) (0 disables it; 0.05 is common).")
        examples = {
            "target_modules": "['q_proj', 'v_proj']), or left out for the attention and MLP projections.",
            "target_parameters": "['mlp.experts.gate_up_proj', 'mlp.experts.down_proj']), or left out.",
            "modules_to_save": "['gate'], a mixture of experts' router), or left out.",
        }
        for key, example in examples.items():
            value = getattr(self, key)
            if value is None:
                continue
            names = (value,) if isinstance(value, str) else tuple(value)
            if not names or not all(isinstance(n, str) and n.strip() for n in names):
                what = "module" if key != "target_parameters" else "parameter"
                raise OptionsError(f"lora {key}={value!r} must be a non-empty list of {what} names (e.g. {example}")
            object.__setattr__(self, key, names)  # a tuple: the options stay hashable
        if self.target_parameters and self.dropout:
            raise OptionsError(
                f"lora dropout={self.dropout!r} with target_parameters: LoRA on a parameter adds its delta to the"
                " weight, so no input is dropped (peft refuses it too). Set lora.dropout: 0, or leave target_parameters"
                " out."
            )
        if self.quantize not in QUANTIZE:
            raise OptionsError(f"lora quantize={self.quantize!r} is not one of {QUANTIZE} ('nf4' for QLoRA).")
        if not isinstance(self.autocast_adapter_dtype, bool):
            raise OptionsError(
                f"lora autocast_adapter_dtype={self.autocast_adapter_dtype!r} must be true or false (false keeps the"
                " adapters in the base model's dtype, e.g. bf16; true, peft's default, upcasts them to fp32)."
            )


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, layer)`` for every peft LoRA layer in ``model`` (a ``PeftModel`` or the model inside one)."""
    if "peft" not in sys.modules:
        return
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should hold: those that require gradients (with LoRA: the adapters).

    Building the optimizer over these (not ``model.parameters()``) keeps it from holding momentum or Adam
    state for the frozen base; under pipeline parallelism they are this rank's stages' parameters.
    """
    return [param for param in model.parameters() if param.requires_grad]


def apply_lora(model: nn.Module, options: LoraOptions) -> PeftModel:
    """Wrap a transformers causal LM with LoRA adapters (``peft.get_peft_model``); NF4 base for QLoRA.

    Call it before :func:`lightning_plugins.parallelize`, after seeding every rank identically (adapters start from
    the global RNG; replicated halves must agree across ranks), on a model with real weights or on the meta device.
    On a meta-device model the adapters are built real (as on a loaded model, see :mod:`.meta_base`) and the base stays
    on meta (with ``quantize="nf4"`` as NF4 weights of the right sizes), for each rank to read its slices of the
    checkpoint after ``parallelize`` (:func:`lightning_plugins.checkpoint.load.load_sharded_safetensors`). Called under
    ``torch.device("meta")`` (the planner's dry run), the adapters stay on the meta device too.

    Args:
        model: A transformers causal LM (``AutoModelForCausalLM``), not parallelized and not yet wrapped.
        options: The LoRA settings.

    Returns:
        The ``PeftModel``; only its adapters require gradients.

    Raises:
        OptionsError: for a model that is already a peft model or already parallelized, and for target
            modules that name nothing in the model (naming the linear layers it has).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if isinstance(model, PeftModel) or any(True for _ in lora_layers(model)):
        raise OptionsError(
            f"apply_lora: {type(model).__name__} already has LoRA adapters. Pass the bare transformers model, or"
            " parallelize the PeftModel you built as it is."
        )
    if any(isinstance(param, DTensor) for param in model.parameters()):
        raise OptionsError(
            "apply_lora: the model is already parallelized (it holds DTensor parameters); adapters added now would"
            " be built with the local shapes. Apply LoRA first, then `lightning_plugins.parallelize`."
        )
    targets = options.target_modules or _default_targets(model)
    _check_targets(model, targets, options)
    config = LoraConfig(
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=list(targets),
        target_parameters=list(options.target_parameters or ()) or None,
        modules_to_save=list(options.modules_to_save or ()) or None,
        use_rslora=options.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    on_meta = any(param.is_meta for param in model.parameters())
    # Under `torch.device("meta")` (the planner's dry run) the adapters are wanted on meta too.
    real_adapters = on_meta and not torch.empty(()).is_meta
    with warnings.catch_warnings(), real_adapters_on_meta_base(model) if real_adapters else nullcontext():
        # peft reads a transformers attribute deprecated in 5.x: not something the user can act on.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=options.autocast_adapter_dtype)
    if options.quantize == "nf4":
        from lightning_plugins.adapters.qlora import quantize_base_to_nf4

        # On the meta device, NF4 weights of the right sizes: each rank quantizes what it keeps when it loads.
        quantize_base_to_nf4(peft_model, shapes_only=on_meta)
    return peft_model


def check_lora_targets(config: Any, options: LoraOptions) -> None:
    """Check the names in ``options`` (``target_modules``, ``target_parameters``, ``modules_to_save``) against a model
    config before any weight is loaded (on the meta device).

    Raises:
        OptionsError: naming the key, the names that match nothing, and what the model has.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    _check_targets(model, options.target_modules or _default_targets(model), options)


def _default_targets(model: nn.Module) -> tuple[str, ...]:
    """The last name component of the family's column- and row-parallel projections (attention and MLP) that the
    model has; for an image-text model, the full names of those in its language model (its vision tower may hold
    linears of the same names, e.g. Qwen2.5-VL's ``mlp.gate_proj``: adapted only when named)."""
    try:  # a registered family, or one read from the config's TP plan (its projections are the defaults)
        family = family_for(model)
    except LayoutError:  # neither: no default projections (named below)
        family = family_for(model, tensor_parallel=False)
    # Only those the model has: a mixture-of-experts layer has no dense MLP (its experts are adapted with
    # target_parameters), while Qwen2-MoE's shared expert has one.
    present = {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    names = tuple(name for name in projection_names(family) if name in present)
    if not names:
        raise OptionsError(
            f"apply_lora: model type {family.name!r} has no known attention/MLP projections. Name the modules to"
            f" adapt: LoraOptions(target_modules=[...]) from its linear layers {_linear_names(model)}."
        )
    parts = image_text_parts(model)
    if parts is None:
        return names
    language = model.get_submodule(parts.language_path)
    return tuple(
        f"{parts.language_path}.{name}"
        for name, module in language.named_modules()
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in names
    )


def _check_targets(model: nn.Module, targets: tuple[str, ...], options: LoraOptions) -> None:
    """Every name must match something, by peft's rules: a target module its full name or last components, a target
    parameter likewise, a module to save the end of a module's full name."""
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise OptionsError(
            f"apply_lora: target_modules {missing} name no module of {type(model).__name__}. Its linear layers are"
            f" {_linear_names(model)}; use some of those (e.g. lora.target_modules: [q_proj, v_proj])."
        )
    params = dict(model.named_parameters())
    experts = {name for name, param in params.items() if param.dim() == 3}
    wrong = [  # naming nothing, or a weight that is not an experts' (the engine runs LoRA on those only)
        t
        for t in options.target_parameters or ()
        if not (matched := {n for n in params if n == t or n.endswith(f".{t}")}) or not matched <= experts
    ]
    if wrong:
        have = f"Its expert weights are {_layer_names(experts)}" if experts else "It has no expert weights (3-D)"
        raise OptionsError(
            f"apply_lora: target_parameters {wrong} name no expert weight of {type(model).__name__}. {have}; LoRA on"
            " parameters is for a mixture of experts' fused weights (e.g. lora.target_parameters:"
            " [mlp.experts.gate_up_proj, mlp.experts.down_proj]); adapt other layers with target_modules."
        )
    missing = [t for t in options.modules_to_save or () if not any(n.endswith(t) for n in names)]
    if missing:
        raise OptionsError(
            f"apply_lora: modules_to_save {missing} name no module of {type(model).__name__}. Its decoder layers hold"
            f" {_layer_names(n for n in names if '.layers.' in n)}; name one of those or its last component (e.g."
            " lora.modules_to_save: [gate] for a mixture of experts' router)."
        )


def _layer_names(names: Iterable[str]) -> list[str]:
    """Names inside a decoder layer (``model.layers.3.mlp.gate`` -> ``mlp.gate``), each once."""
    return sorted({name.split(".layers.", 1)[-1].partition(".")[2] for name in names} - {""})


def _linear_names(model: nn.Module) -> list[str]:
    return sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
