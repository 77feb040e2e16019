"""What differs per model family: which modules split how, where the layers and norms are.

A family is data, not a fork of the HF modeling code. Families not registered here fall back to the
``base_model_tp_plan`` that transformers ships in their config (see :func:`family_for`), and get sequence
parallelism where the model's structure allows it (see :func:`_with_sequence_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.image_text import image_text_parts
from lightning_plugins.parallel.linear_attention import LINEAR_PROJECTIONS


@dataclass(frozen=True)
class ModelFamily:
    """The module names tensor/sequence parallelism needs, relative to the causal-LM model.

    Attributes:
        name: Human-readable family name.
        layers: Dotted path of the ``ModuleList`` of decoder layers.
        final_norm: Dotted path of the norm after the last layer ("" when unknown).
        colwise: Linear layers (relative to a decoder layer) split along their output features.
        rowwise: Linear layers (relative to a decoder layer) split along their input features.
        layer_norms: Norms inside a decoder layer (sequence-sharded under sequence parallelism).
        head_norms: Norms applied per attention head (q/k norms), whose input is split by heads.
        tp_regions: Sub-modules of a decoder layer whose input must be the whole sequence
            (the all-gather point under sequence parallelism).
        sequence_parallel: Whether the family's forward is known to work with a sequence-sharded
            residual stream (false for the generic fallback).
        head_params: Parameters (relative to a decoder layer) with one entry per attention head, split with the
            heads over tp (gpt-oss's attention sinks).
        linear_attention: Gated DeltaNet linear-attention modules (relative to a decoder layer; Qwen3.5's
            ``linear_attn``), split by heads over tp (:mod:`lightning_plugins.parallel.linear_attention`); each is a
            region too. A layer holds either these or the softmax attention: names a layer lacks are skipped.
    """

    name: str
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    colwise: tuple[str, ...] = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    )
    rowwise: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    head_norms: tuple[str, ...] = ()
    tp_regions: tuple[str, ...] = ("self_attn", "mlp")
    sequence_parallel: bool = True
    extra_styles: dict[str, str] = field(default_factory=dict)
    head_params: tuple[str, ...] = ()
    linear_attention: tuple[str, ...] = ()


LLAMA = ModelFamily("llama")
QWEN3 = ModelFamily("qwen3", head_norms=("self_attn.q_norm", "self_attn.k_norm"))
#: Qwen3.5: three of every four layers hold a Gated DeltaNet ``linear_attn`` instead of ``self_attn`` (whose q_proj
#: holds each head's query and output gate side by side, so a column split keeps them together).
QWEN3_5 = replace(
    QWEN3, name="qwen3_5_text", tp_regions=("self_attn", "linear_attn", "mlp"), linear_attention=("linear_attn",)
)

#: ``config.model_type`` -> family. Llama 2/3/3.1/3.2, Mistral and Qwen2/2.5 share one layout
#: (Qwen2's q/k/v bias is split with its weight by ``ColwiseParallel``). In a mixture-of-experts layer the block that
#: routes tokens is found by structure (:func:`lightning_plugins.parallel.moe.experts.moe_block_name`) and runs on each
#: rank's tokens; the names below that fall inside it are skipped there (they serve the family's dense layers).
FAMILIES: dict[str, ModelFamily] = {
    "llama": LLAMA,
    "mistral": ModelFamily("mistral"),
    "qwen2": ModelFamily("qwen2"),
    "qwen3": QWEN3,
    "mixtral": ModelFamily("mixtral"),
    "qwen2_moe": ModelFamily("qwen2_moe"),
    "qwen3_moe": ModelFamily("qwen3_moe", head_norms=QWEN3.head_norms),
    # Attention sinks: one learned logit per head, split with the heads (q/k/v/o carry biases, split with them).
    "gpt_oss": ModelFamily("gpt_oss", head_params=("self_attn.sinks",)),
    "qwen3_5_text": QWEN3_5,
    "qwen3_5_moe_text": replace(QWEN3_5, name="qwen3_5_moe_text"),
    # Qwen3-Next: the same layers; its Gated DeltaNet fuses q/k/v/z and b/a per key head.
    "qwen3_next": replace(QWEN3_5, name="qwen3_next"),
    # Qwen3-VL's language models (the image-text model's text config): Qwen3's layers, whose per-head q/k norms their
    # configs' tensor-parallel plans leave out (the dense one's plan names no layer at all).
    "qwen3_vl_text": replace(QWEN3, name="qwen3_vl_text"),
    "qwen3_vl_moe_text": replace(QWEN3, name="qwen3_vl_moe_text"),
}

#: HF ``base_model_tp_plan`` styles this engine can translate for the generic fallback.
_HF_STYLES = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce"}


def family_for(model: nn.Module, *, tensor_parallel: bool = True) -> ModelFamily:
    """Return the family of a transformers causal LM, or a fallback built from its config's TP plan.

    Args:
        model: A ``transformers.PreTrainedModel`` (a causal LM with ``.config``).
        tensor_parallel: Whether the caller will apply tensor parallelism (a model with no plan
            can still be data/pipeline parallel).

    Raises:
        LayoutError: if the model is not a transformers model, or tensor parallelism is asked for a
            model that has neither a registered family nor a ``base_model_tp_plan``.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or model_type is None:
        raise LayoutError(
            f"{type(model).__name__} is not a transformers PreTrainedModel (no `.config.model_type`). Pass a"
            f" causal LM such as `AutoModelForCausalLM.from_config(...)`; supported families: {sorted(FAMILIES)}."
        )
    if isinstance(model, nn.Module) and (parts := image_text_parts(model)) is not None:
        return _language_model_family(model, parts.language_path, tensor_parallel)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    plan = dict(getattr(config, "base_model_tp_plan", None) or {}) if tensor_parallel else {}
    if not plan:
        if tensor_parallel:
            raise LayoutError(
                f"Model type '{model_type}' has no registered family and its config has no `base_model_tp_plan`, so"
                f" it cannot be tensor-parallel. Use tp_size=1 (FSDP2 still works) or one of {sorted(FAMILIES)}."
            )
        return ModelFamily(
            model_type,
            layers=f"{getattr(model, 'base_model_prefix', 'model')}.layers",
            final_norm="",
            colwise=(),
            rowwise=(),
            layer_norms=(),
            tp_regions=(),
            sequence_parallel=False,
        )
    family = _family_from_hf_plan(model_type, plan, getattr(model, "base_model_prefix", "model"))
    return _with_sequence_parallel(family, model) if isinstance(model, nn.Module) else family


def _language_model_family(model: nn.Module, language: str, tensor_parallel: bool) -> ModelFamily:
    """The family of an image-text model's language model (at ``language``, e.g. ``model.language_model``): its text
    config's, with the paths of its layers and final norm inside the image-text model."""
    text = model.config.get_text_config(decoder=True)
    family = FAMILIES.get(text.model_type)
    if family is None:
        plan = dict(getattr(text, "base_model_tp_plan", None) or {})
        if tensor_parallel and not plan:
            raise LayoutError(
                f"The language model of {type(model).__name__} (model type '{text.model_type}') has no registered"
                f" family and its text config has no `base_model_tp_plan`, so it cannot be tensor-parallel. Use"
                " tp_size=1 (FSDP2 still works)."
            )
        family = _family_from_hf_plan(text.model_type, plan, "model")
    norm = f"{language}.{family.final_norm.partition('.')[2] or 'norm'}"
    try:
        has_norm = is_norm(model.get_submodule(norm))
    except AttributeError:
        has_norm = False
    # Sequence parallelism would shard the embeddings the vision tower's output is placed into: off (the text family's
    # regions and norms are kept, so tensor parallelism splits the language model as it splits the text decoder).
    return replace(
        family,
        layers=f"{language}.{family.layers.partition('.')[2]}",
        final_norm=norm if has_norm else "",
        sequence_parallel=False,
    )


def _family_from_hf_plan(model_type: str, plan: dict[str, str], prefix: str) -> ModelFamily:
    """The family a config's ``base_model_tp_plan`` describes: its projections, without sequence parallelism."""
    # Routed experts are the engine's own (parallel/moe/experts.py), whatever the plan says of them.
    plan = {key: style for key, style in plan.items() if ".experts" not in key}
    unknown = {style for style in plan.values() if style not in _HF_STYLES}
    if unknown:
        raise LayoutError(
            f"Model type '{model_type}' is not registered and its `base_model_tp_plan` uses styles this engine does"
            f" not translate: {sorted(unknown)}. Use tp_size=1 or one of {sorted(FAMILIES)}."
        )
    per_layer = {key.removeprefix("layers.*."): style for key, style in plan.items() if key.startswith("layers.*.")}
    return ModelFamily(
        model_type,
        layers=f"{prefix}.layers",
        final_norm="",  # unnamed in the plan: its weight is replicated with the other leftovers
        colwise=tuple(k for k, s in per_layer.items() if s == "colwise"),
        rowwise=tuple(k for k, s in per_layer.items() if s == "rowwise"),
        layer_norms=(),
        head_norms=tuple(k for k, s in per_layer.items() if s == "replicated_with_grad_allreduce"),
        tp_regions=(),
        sequence_parallel=False,
        extra_styles={k: s for k, s in per_layer.items() if s in ("colwise_gather_output", "rowwise_split_input")},
    )


def _with_sequence_parallel(family: ModelFamily, model: nn.Module) -> ModelFamily:
    """``family`` with sequence parallelism, where ``model``'s structure is the one it needs; else ``family``.

    Sequence parallelism needs every parameter that touches the residual stream between the planned regions to
    act on each token alone: each direct child of a decoder layer is a region the plan splits (attention, MLP:
    its input is gathered to the whole sequence), a norm (pre- or post-norm, sequence-sharded), or holds no
    parameters; next to the layers the base model holds the embedding, one final norm and parameter-free
    modules (rotary embeddings). Gemma's, Granite's and Phi-3's scalings of the stream are per-token too.
    """
    layers = decoder_layers(model, family)
    planned = (*family.colwise, *family.rowwise, *family.head_norms, *family.extra_styles)
    regions = tuple(dict.fromkeys(name.partition(".")[0] for name in planned))
    norms: dict[str, None] = {}
    for layer in layers:
        for name, child in layer.named_children():
            if name in regions or not any(True for _ in child.parameters()):
                continue
            if not is_norm(child):
                return family  # e.g. a learned gate on the residual stream: left replicated
            norms[name] = None
    base = model.get_submodule(family.layers.rpartition(".")[0])
    final: list[str] = []
    for name, child in base.named_children():
        if child is layers or child is model.get_input_embeddings() or not any(True for _ in child.parameters()):
            continue
        if not is_norm(child):
            return family
        final.append(name)
    if len(final) != 1 or not all(all(name in dict(layer.named_children()) for name in regions) for layer in layers):
        return family
    return replace(
        family,
        final_norm=f"{family.layers.rpartition('.')[0]}.{final[0]}",
        layer_norms=tuple(norms),
        tp_regions=regions,
        sequence_parallel=True,
    )


def is_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a per-token normalisation (LayerNorm, or a family's RMSNorm) with its own 1-D weight."""
    params = list(module.parameters())
    is_norm_class = isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__
    return is_norm_class and not list(module.children()) and all(param.dim() == 1 for param in params)


def projection_names(family: ModelFamily) -> tuple[str, ...]:
    """The last name component of each projection a family splits under TP (``q_proj``, ..., Phi-3's fused
    ``qkv_proj`` and ``gate_up_proj``): LoRA's default targets."""
    linear = (f"{module}.{name}" for module in family.linear_attention for name in LINEAR_PROJECTIONS)
    paths = (*family.colwise, *family.rowwise, *family.extra_styles, *linear)
    return tuple(dict.fromkeys(path.rpartition(".")[2] for path in paths))


def decoder_layers(model: nn.Module, family: ModelFamily) -> nn.ModuleList:
    """The ``ModuleList`` of decoder layers of ``model``.

    Falls back to the list whose entries are the model's ``_no_split_modules`` classes (e.g. GPT-2's
    ``transformer.h``) when the family's path does not exist.
    """
    try:
        return model.get_submodule(family.layers)  # type: ignore[return-value]
    except AttributeError:
        pass
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in block_names:
            return module
    raise LayoutError(
        f"Cannot find the decoder layers of {type(model).__name__} (tried '{family.layers}' and the model's"
        f" _no_split_modules {sorted(block_names)})."
    )


def final_norm(model: nn.Module, family: ModelFamily) -> nn.Module | None:
    """The norm between the last decoder layer and the head: the family's, else the base model's ``norm`` (the piece
    a pipeline stage runs, see :mod:`~lightning_plugins.parallel.pipeline.anatomy`); ``None`` when neither is a norm.
    """
    try:
        if family.final_norm:
            norm = model.get_submodule(family.final_norm)
        else:
            norm = getattr(getattr(model, "base_model", model), "norm", None)
    except AttributeError:
        return None
    return norm if isinstance(norm, nn.Module) and is_norm(norm) else None


def check_supported(model: Any) -> None:
    """Refuse models that are already wrapped by another data-parallel engine."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for module in model.modules():
        if isinstance(module, (FullyShardedDataParallel, DistributedDataParallel)):
            raise LayoutError(
                f"The model is already wrapped in {type(module).__name__}; this engine applies FSDP2 itself. Pass the"
                " bare transformers model (unwrap it, e.g. `wrapped.module`) to `parallelize`."
            )


def hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``transformers.PreTrainedModel`` instances in ``module`` (itself included), with their names."""
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(
            outer == "" or name.startswith(f"{outer}.") for outer, _ in found
        ):
            found.append((name, sub))
    return found


def find_hf_model(
    module: nn.Module,
    owner: str,
    fix: str = "or call `lightning_plugins.parallelize(model, mesh)` on the model yourself",
) -> nn.Module:
    """The one outermost ``transformers.PreTrainedModel`` inside ``module`` (itself, or inside a ``PeftModel``).

    Args:
        module: What a door was handed (a LightningModule, the model given to ``prepare``).
        owner: Who asks, for the message (e.g. the strategy's class name).
        fix: The door's other way out, ending the message.

    Raises:
        LayoutError: if there is none, or several unrelated ones.
    """
    found = hf_models(module)
    if len(found) != 1:
        what = "no transformers PreTrainedModel" if not found else f"{len(found)} models ({[n for n, _ in found]})"
        raise LayoutError(
            f"{owner} found {what} inside {type(module).__name__}. Keep exactly one HF causal LM in it (e.g."
            f" `self.model = AutoModelForCausalLM.from_config(...)`, or a peft `PeftModel` around one), {fix}."
        )
    return found[0][1]
