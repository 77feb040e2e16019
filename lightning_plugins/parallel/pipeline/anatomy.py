"""What a decoder's own forward does around its layers, read from the model's structure: :class:`DecoderAnatomy`.

A pipeline stage re-runs the decoder stack piece by piece, so it must do exactly what the model's ``forward``
does between the pieces. Transformers' decoders all follow one shape, and the variations sit in known places:

* **Embedding.** The embedding module's own forward (Gemma's ``*ScaledWordEmbedding`` scales by
  ``sqrt(hidden_size)`` in the weight's dtype), then the base model's ``embedding_multiplier`` (Granite) and
  ``embedding_dropout`` (StarCoder2).
* **Per layer.** The mask of the layer's attention type (``config.layer_types``: full or sliding) and the rotary
  embedding, per layer type when the rotary module takes one (Gemma 3's local and global RoPE). A linear-attention
  layer (Qwen3.5's and Qwen3-Next's Gated DeltaNet) gets what their decoders give it: the 2-D padding mask
  (:func:`~lightning_plugins.parallel.pipeline.stage.recurrent_padding_mask`) and no cache; the shared rotary
  embedding passed along is unused there. A linear-attention layer without a Gated DeltaNet is refused: other
  hybrid decoders give theirs other inputs. Everything else (post-norms, fused projections, sinks, soft-capped
  attention, residual multipliers) is inside the layer.
* **Head.** The final norm, ``lm_head``, then the causal LM's logit transforms from its config:
  ``logits / logits_scaling`` (Granite), ``logits * logit_scale`` (Cohere),
  ``tanh(logits / cap) * cap`` with ``final_logit_softcapping`` (Gemma 2 and 3).

:func:`decoder_anatomy` finds these on the model and refuses, naming it, anything else a forward could hide from
a stage: a module of the base model or the causal LM that is not one of the pieces above, a scalar attribute
the stage would not apply, an attention type with no mask here, a linear-attention layer that is not a Gated
DeltaNet, a layer that does not take its mask and rotary embedding. :func:`check_stageable_config` runs the config
part before any weight exists.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.linear_attention import is_gated_delta_net

__all__ = [
    "ATTENTION_KINDS",
    "UNROTATED_KINDS",
    "DecoderAnatomy",
    "attention_kinds",
    "check_stageable_config",
    "decoder_anatomy",
    "head_transforms",
]

#: Attention types (``config.layer_types``) whose masks a stage builds (the names transformers gives them).
ATTENTION_KINDS = ("full_attention", "sliding_attention", "linear_attention")
#: Attention types whose layers take no rotary embedding (a stage computes none for a stage of only those).
UNROTATED_KINDS = ("linear_attention",)
#: The base model's pieces a stage runs; any other submodule is a step of its forward the stage would miss.
_BASE_PIECES = {"embed_tokens", "layers", "norm", "rotary_emb"}
#: Scalars on the base model that a stage applies or that do not act in the forward.
_BASE_SCALARS = {"embedding_multiplier", "embedding_dropout", "padding_idx", "vocab_size", "gradient_checkpointing"}
#: Scalars on the causal LM that a stage applies (from the config), that do not act in the forward, or that weigh
#: a mixture-of-experts router's load-balancing loss (the engine's own: see parallel/moe/router_loss.py).
_HEAD_SCALARS = {
    "vocab_size",
    "logit_scale",
    "logits_scaling",
    "is_parallelizable",
    "model_parallel",
    "supports_gradient_checkpointing",
    "num_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
}
#: Config switches that change what the base model's forward does in ways a stage does not reproduce.
_REFUSED_SWITCHES = {"use_bidirectional_attention": "bidirectional attention overlays on the causal masks"}


@dataclass(frozen=True)
class DecoderAnatomy:
    """The transforms around the decoder layers of one model (see the module docstring).

    Attributes:
        embedding_multiplier: Multiplies the embeddings (``None``: not applied).
        embedding_dropout: Dropout probability on the embeddings in training (``None``: not applied).
        rotary_per_layer_type: The rotary module takes the layer type (one embedding per attention type).
        logits_scaling: Divides the logits (``None``: not applied).
        logit_scale: Multiplies the logits (``None``: not applied).
        final_logit_softcapping: ``tanh(logits / cap) * cap`` (``None``: not applied).
    """

    embedding_multiplier: float | None = None
    embedding_dropout: float | None = None
    rotary_per_layer_type: bool = False
    logits_scaling: float | None = None
    logit_scale: float | None = None
    final_logit_softcapping: float | None = None

    def embed(self, hidden: Tensor, training: bool) -> Tensor:
        """After the embedding module: the base model's multiplier and dropout, as its forward applies them."""
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        if self.embedding_dropout is not None:
            hidden = nn.functional.dropout(hidden, p=self.embedding_dropout, training=training)
        return hidden

    def rotary(self, rotary: nn.Module, hidden: Tensor, position_ids: Tensor, kinds: set[str]) -> dict[str, Any]:
        """The rotary embedding each attention type in ``kinds`` uses (``None`` for a type without one).

        A shared embedding also goes to linear-attention layers, as the decoders' forward passes it (they ignore it);
        a stage whose layers are all linear attention computes none.
        """
        rotated = {kind for kind in kinds if kind not in UNROTATED_KINDS}
        if not rotated:
            return dict.fromkeys(kinds)
        if self.rotary_per_layer_type:
            return {kind: rotary(hidden, position_ids, kind) if kind in rotated else None for kind in kinds}
        shared = rotary(hidden, position_ids)
        return dict.fromkeys(kinds, shared)

    def logits(self, logits: Tensor) -> Tensor:
        """After ``lm_head``: the causal LM's logit transforms, in its forward's order."""
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_logit_softcapping is not None:
            logits = (logits / self.final_logit_softcapping).tanh() * self.final_logit_softcapping
        return logits


def attention_kinds(config: Any) -> list[str]:
    """The attention type of every layer, as the model's own forward picks its mask."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return list(layer_types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers


def _refuse(config: Any, pp_size: int, what: str) -> LayoutError:
    return LayoutError(
        f"pp_size={pp_size}: a pipeline stage cannot reproduce the forward of model_type"
        f" {getattr(config, 'model_type', None)!r}: {what}. Use pp_size=1 for this model (FSDP2, tensor and context"
        " parallelism do not re-run its forward)."
    )


def check_stageable_config(config: Any, pp_size: int) -> None:
    """Refuse a config whose forward a stage cannot reproduce (attention types, switches); needs no weights.

    Raises:
        LayoutError: naming the attention type or switch that blocks staging.
    """
    kinds = attention_kinds(config)
    unknown = sorted(set(kinds) - set(ATTENTION_KINDS))
    if unknown:
        where = [index for index, kind in enumerate(kinds) if kind in unknown]
        raise _refuse(
            config,
            pp_size,
            f"its layer_types include {unknown} (layers {where}), and stages build masks for {list(ATTENTION_KINDS)}"
            " only",
        )
    for switch, what in _REFUSED_SWITCHES.items():
        if getattr(config, switch, False):
            raise _refuse(config, pp_size, f"config.{switch}=True ({what})")


def _scalars(module: nn.Module) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def decoder_anatomy(model: nn.Module, pp_size: int = 2) -> DecoderAnatomy:
    """Read what ``model``'s forward does around its layers, refusing what a stage cannot reproduce.

    Args:
        model: A transformers causal LM (materialised or on the meta device).
        pp_size: For the message.

    Raises:
        LayoutError: naming the module, attribute, attention type or layer signature that blocks staging.
    """
    config = model.config
    base, prefix, allowed = _decoder_base(model, pp_size)
    config = getattr(base, "config", config)  # an image-text model's: its language model's
    check_stageable_config(config, pp_size)
    if base is model:
        raise _refuse(config, pp_size, f"{type(model).__name__} has no base model under a language-model head")
    missing = sorted(
        f"{prefix}.{name}" for name in _BASE_PIECES if not isinstance(getattr(base, name, None), nn.Module)
    )
    extra = sorted(f"{prefix}.{name}" for name, _ in base.named_children() if name not in _BASE_PIECES)
    extra += sorted(name for name, _ in model.named_modules() if name.count(".") < prefix.count(".") + 1
                    and name and not allowed(name))  # fmt: skip
    if missing or extra:
        what = [f"its forward runs {extra}, which a stage does not"] if extra else []
        what += [f"it has no {missing}, which a stage runs"] if missing else []
        raise _refuse(config, pp_size, "; ".join(what))
    scalars = sorted(_scalars(base) - _BASE_SCALARS) + sorted(_scalars(model) - _HEAD_SCALARS)
    if scalars:
        what = f"its forward may apply the scalar attribute(s) {scalars}, which a stage does not"
        raise _refuse(config, pp_size, what)
    _check_linear_attention_layers(base, prefix, config, pp_size)
    layer = next(iter(base.layers), None)
    if layer is not None:
        params = inspect.signature(layer.forward).parameters
        if not {"attention_mask", "position_embeddings"} <= set(params):
            raise _refuse(
                config,
                pp_size,
                f"its layers ({type(layer).__name__}) do not take `attention_mask` and `position_embeddings`",
            )
    multiplier, dropout = getattr(base, "embedding_multiplier", None), getattr(base, "embedding_dropout", None)
    return DecoderAnatomy(
        embedding_multiplier=None if multiplier is None else float(multiplier),
        embedding_dropout=None if dropout is None else float(dropout),
        rotary_per_layer_type="layer_type" in inspect.signature(base.rotary_emb.forward).parameters,
        **_head_fields(model),
    )


def _decoder_base(model: nn.Module, pp_size: int) -> tuple[nn.Module, str, Any]:
    """The decoder a stage re-runs (its path) and which of the model's other modules (by name) a stage runs too: a
    causal LM's base model beside ``lm_head``; an image-text model's language model, beside the image path and the
    multimodal base model whose forward runs up to it (:mod:`.image_text`)."""
    from lightning_plugins.parallel.image_text import image_text_parts
    from lightning_plugins.parallel.pipeline.image_text import check_stageable_language_model

    parts = image_text_parts(model)
    if parts is None:
        prefix = model.base_model_prefix
        return model.base_model, prefix, lambda name: name in (prefix, "lm_head")
    language = model.get_submodule(parts.language_path)
    check_stageable_language_model(language, model.config, pp_size)
    image_path = (parts.vision_path, *parts.projector_paths)

    def allowed(name: str) -> bool:
        above = parts.language_path.startswith(f"{name}.") or name == parts.language_path
        return above or name == "lm_head" or any(name == path or name.startswith(f"{path}.") for path in image_path)

    return language, parts.language_path, allowed


def _check_linear_attention_layers(base: nn.Module, prefix: str, config: Any, pp_size: int) -> None:
    """Refuse a ``linear_attention`` layer without a Gated DeltaNet: a stage gives such a layer the padding mask that
    Qwen3.5's and Qwen3-Next's decoders give theirs, and other hybrids' decoders give their layers other inputs."""
    kinds = attention_kinds(config)
    for key, layer in base.layers.named_children():
        if kinds[int(key)] in UNROTATED_KINDS and not any(is_gated_delta_net(module) for module in layer.modules()):
            what = (
                f"{prefix}.layers.{key} ({type(layer).__name__}) is a linear_attention layer without a Gated DeltaNet,"
                " and stages give linear-attention layers only what Qwen3.5's and Qwen3-Next's decoders give theirs"
            )
            raise _refuse(config, pp_size, what)


def _head_fields(model: nn.Module) -> dict[str, Any]:
    config = model.config
    return {
        "logits_scaling": getattr(model, "logits_scaling", getattr(config, "logits_scaling", None)),
        "logit_scale": getattr(model, "logit_scale", None),
        "final_logit_softcapping": getattr(config, "final_logit_softcapping", None),
    }


def head_transforms(model: nn.Module) -> DecoderAnatomy | None:
    """The causal LM's logit transforms only (what its forward does between ``lm_head`` and the loss).

    Returns:
        ``None`` when its forward may do more there than :meth:`DecoderAnatomy.logits` applies: a submodule other
        than the base model and ``lm_head``, or a scalar attribute the transforms do not cover.
    """
    children = {name for name, _ in model.named_children()} - {getattr(model, "base_model_prefix", ""), "lm_head"}
    if children or _scalars(model) - _HEAD_SCALARS or getattr(model, "config", None) is None:
        return None
    return DecoderAnatomy(**_head_fields(model))
