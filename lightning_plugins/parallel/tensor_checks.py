"""What tensor parallelism can split, checked before anything is split (no collective runs): every parameter of a
region it splits has a rule, and every peft layer is a plain LoRA on a projection it splits."""

from __future__ import annotations

import sys

from torch import nn

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.moe.experts import moe_block_name
from lightning_plugins.parallel.families import ModelFamily, decoder_layers, is_norm
from lightning_plugins.parallel.linear_attention import LINEAR_PROJECTIONS, linear_attention_problem


def check_tensor_parallel(model: nn.Module, family: ModelFamily, tp_size: int) -> None:
    """Refuse a decoder layer whose split would be partial, before anything is split (no collective runs).

    Tensor parallelism splits a region of a layer (attention, MLP, what the family's plan names) through its planned
    projections; any other parameter the region holds would be replicated and meet the split projections' outputs
    in the region's own forward (a convolution over the split channels, per-head decays of a linear attention such as
    Qwen3-Next's Gated DeltaNet ``linear_attn``, whose fused projections its config's plan only names): torch then
    fails inside the forward (``got mixed torch.Tensor and DTensor``), or the math is wrong. Norms, the family's
    per-head parameters, the routed-experts block and peft adapters (checked by their own rules) are known; anything
    else is refused here, naming the module. A family's linear-attention modules (Qwen3.5's) are split by heads
    (:mod:`lightning_plugins.parallel.linear_attention`): one whose heads tp does not divide, or whose parameters
    that split has no rule for, is refused.

    Raises:
        LayoutError: naming the first such module, its parameters and ``tp_size``.
    """
    planned = (*family.colwise, *family.rowwise, *family.extra_styles)
    known = (*planned, *family.head_norms, *family.layer_norms)
    regions = tuple(dict.fromkeys(name.partition(".")[0] for name in planned))
    regions = tuple(region for region in regions if region not in family.linear_attention)
    prefix = family.layers
    for index, layer in enumerate(decoder_layers(model, family)):
        for name in family.linear_attention:
            module = submodule_or_none(layer, name)
            if module is not None and (problem := linear_attention_problem(module, tp_size)) is not None:
                raise LayoutError(
                    f"tp_size={tp_size}: tensor parallelism cannot split {prefix}.{index}.{name}"
                    f" ({type(module).__name__}) of this {family.name} model by heads: {problem}. Use a tp_size that"
                    " divides its key and value heads, or tp_size=1 (FSDP2 with dp_shard_size shards it)."
                )
        block = moe_block_name(layer)
        adapters = adapter_names(layer)
        for region in regions:
            module = submodule_or_none(layer, region)
            if module is None or region == block:
                continue
            unsplit = []
            for name, sub in module.named_modules(prefix=region):
                own = [key for key, _ in sub.named_parameters(recurse=False)]
                if not own or any(name == k or name.startswith(f"{k}.") for k in (*known, *adapters)):
                    continue
                if block is not None and (name == block or name.startswith(f"{block}.")):
                    continue
                if is_norm(sub):
                    continue
                own = [f"{name}.{key}" for key in own if f"{name}.{key}" not in family.head_params]
                unsplit += [key.removeprefix(f"{region}.") for key in own]
            if unsplit:
                raise LayoutError(
                    f"tp_size={tp_size}: tensor parallelism cannot split {prefix}.{index}.{region}"
                    f" ({type(module).__name__}) of this {family.name} model: it splits only the projections"
                    f" {sorted(n.partition('.')[2] for n in planned if n.startswith(f'{region}.'))}, and the layer's"
                    f" forward would mix them with {sorted(unsplit)}, which it has no rule for (e.g. a linear"
                    " attention's convolution and decays). Use tp_size=1 for this model (FSDP2 with dp_shard_size"
                    " shards it), or a family whose layers tensor parallelism splits."
                )


def adapter_names(layer: nn.Module) -> list[str]:
    """The peft adapter layers inside ``layer`` (checked by :func:`check_adapters`)."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in layer.named_modules() if isinstance(module, BaseTunerLayer)]


def check_adapters(model: nn.Module, family: ModelFamily) -> None:
    """Refuse peft layers tensor parallelism cannot split, before anything is split.

    Raises:
        LayoutError: for an adapted module that is not one of the decoder projections the family splits,
            a LoRA variant (DoRA...) or a non-linear LoRA layer, and peft's ``modules_to_save`` copies.
    """
    if "peft" not in sys.modules:  # no model holds peft layers unless peft was imported
        return
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    split = {*family.colwise, *family.rowwise, *family.extra_styles}
    split |= {f"{module}.{name}" for module in family.linear_attention for name in LINEAR_PROJECTIONS}
    planned = {
        id(module)
        for layer in decoder_layers(model, family)
        for name in split
        if (module := submodule_or_none(layer, name)) is not None
    }
    projections = sorted({name.rpartition(".")[2] for name in split})
    # A mixture-of-experts block runs whole on each rank's tokens, its weights and adapters replicated over tp.
    token_local = {
        id(module)
        for layer in decoder_layers(model, family)
        if (block := moe_block_name(layer)) is not None
        for module in layer.get_submodule(block).modules()
    }
    for name, module in model.named_modules():
        if id(module) in token_local:
            continue
        if isinstance(module, AuxiliaryTrainingWrapper):
            raise LayoutError(
                f"{name} is a peft modules_to_save / trainable-tokens copy, which tensor parallelism does not split."
                " Leave modules_to_save out of the LoraConfig, or use a layout without tensor parallelism (FSDP2"
                " trains it)."
            )
        if not isinstance(module, BaseTunerLayer):
            continue
        if id(module) not in planned:
            raise LayoutError(
                f"Tensor parallelism splits LoRA adapters only on the decoder projections it splits {projections};"
                f" {name} ({type(module).__name__}) is not one. Target those (LoraConfig(target_modules=...) /"
                " lora.target_modules), or use a layout without tensor parallelism (FSDP2 adapts any linear)."
            )
        variants = sorted(getattr(module, "lora_variant", {}))
        if type(module) is not LoraLinear or variants:
            kind = f"LoRA variant (e.g. DoRA) for adapters {variants}" if variants else type(module).__name__
            raise LayoutError(
                f"{name} has a {kind}; tensor parallelism splits plain LoRA on linear layers only. Use plain LoRA"
                " there, or a layout without tensor parallelism."
            )


def submodule_or_none(layer: nn.Module, name: str) -> nn.Module | None:
    """A layer's sub-module, or ``None`` where the layer lacks it (a mixture-of-experts layer has no dense MLP)."""
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


