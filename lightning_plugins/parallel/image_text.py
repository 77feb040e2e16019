"""The parts of an image-text model (``AutoModelForImageTextToText``), found by structure: vision tower, its blocks, the
projector, the language model.

An image-text model's config holds a ``vision_config`` and a text config; transformers builds each part as a model of
its own from its sub-config, so the vision tower is the outermost module whose ``config`` is the ``vision_config``'s
class and the language model the outermost one whose ``config`` is the text config's (``model.visual`` and
``model.language_model`` for Qwen2.5-VL, ``model.vision_tower`` and ``model.language_model`` for Gemma 3). The
tower's blocks are its longest list of same-class modules. The projector maps the tower's width to the language
model's: the modules next to the two towers that hold parameters (Gemma 3's and LLaVA's ``multi_modal_projector``),
else the tower's own modules after its blocks (Qwen2.5-VL's ``merger``; Qwen3-VL's ``merger`` and
``deepstack_merger_list``). No family is named for its parts: a model whose parts are not where this looks is refused by
name. Families whose parts are found but whose forward cannot run under any layout are refused by their model type,
with the reason (:func:`refused_image_text_family`); those that some layouts cannot split, under those layouts
(:func:`refused_image_text_split`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_plugins.errors import LayoutError

__all__ = [
    "ImageTextParts",
    "check_image_text_layout",
    "image_text_parts",
    "is_image_text",
    "language_config",
    "refused_image_text_family",
    "refused_image_text_split",
]


#: Where a pipeline stage's model keeps its parts as found before its stage dropped the image path.
PARTS_BEFORE_STAGING = "_lightning_plugins_image_text_parts"


@dataclass(frozen=True)
class ImageTextParts:
    """Where an image-text model keeps each of its parts (paths relative to the model given).

    Attributes:
        vision_path: The vision tower (encoder), e.g. ``model.visual``.
        blocks_path: The tower's repeated blocks (a ``ModuleList``), e.g. ``model.visual.blocks``.
        projector_paths: The modules that map the tower's features to the language model's width, each a module with
            a forward of its own (a list of projectors is given entry by entry), e.g. ``("model.visual.merger",)``.
        language_path: The language model (the text decoder's base model), e.g. ``model.language_model``.
    """

    vision_path: str
    blocks_path: str
    projector_paths: tuple[str, ...]
    language_path: str

    def vision_units(self, model: nn.Module) -> list[nn.Module]:
        """The image path's modules that are sharded as their own FSDP2 units: each vision block, then the
        projector's modules."""
        blocks = list(model.get_submodule(self.blocks_path))
        return [*blocks, *(model.get_submodule(path) for path in self.projector_paths)]


def is_image_text(model: Any) -> bool:
    """Whether ``model`` is a transformers model with a vision tower (its config holds a ``vision_config``)."""
    config = getattr(model, "config", None)
    return isinstance(model, nn.Module) and getattr(config, "vision_config", None) is not None


def image_text_parts(model: nn.Module) -> ImageTextParts | None:
    """The parts of an image-text model; ``None`` for a model without a vision tower. A pipeline stage's model that
    dropped its image path (a later stage: :func:`~lightning_plugins.parallel.pipeline.split.build_stages`) gives the
    parts found before (its language model is where it was; the tower and the projector are not there).

    Raises:
        LayoutError: naming the model's class and the part that could not be found, for an image-text model whose
            structure is not the one described in the module doc.
    """
    if not is_image_text(model):
        return None
    if (found := model.__dict__.get(PARTS_BEFORE_STAGING)) is not None:
        return found
    config = model.config
    vision = _outermost_with_config(model, type(config.vision_config))
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    language = _outermost_with_config(model, type(text_config)) if text_config is not config else None
    if vision is None or language is None:
        missing = "vision tower" if vision is None else "language model"
        raise _not_found(model, missing, "no module of it is built from the config's sub-config for it")
    blocks = _blocks(model, vision)
    if blocks is None:
        raise _not_found(model, "vision blocks", f"'{vision}' holds no list of same-class modules")
    projector = _projector(model, vision, language, blocks)
    width = getattr(text_config, "hidden_size", None)
    if not projector or not any(
        width in p.shape for path in projector for p in model.get_submodule(path).parameters()
    ):
        raise _not_found(
            model, "projector", f"no module next to '{vision}' and '{language}' or after '{blocks}' maps to the"
            f" language model's width ({width})"
        )  # fmt: skip
    return ImageTextParts(vision, blocks, projector, language)


def _not_found(model: nn.Module, part: str, why: str) -> LayoutError:
    return LayoutError(
        f"{type(model).__name__} is an image-text model (its config has a vision_config), but its {part} could not be"
        f" found: {why}. The engine finds the vision tower, its blocks, the projector and the language model by"
        " structure (see lightning_plugins.parallel.image_text); this model is not supported yet. Train its text"
        " decoder alone (load the checkpoint with AutoModelForCausalLM on its text_config) or file an issue naming it."
    )


def _outermost_with_config(model: nn.Module, config_class: type) -> str | None:
    """The name of the outermost submodule (not ``model`` itself) whose ``config`` is a ``config_class``."""
    for name, module in model.named_modules():
        if name and type(getattr(module, "config", None)) is config_class:
            return name
    return None


def _blocks(model: nn.Module, vision: str) -> str | None:
    """The longest ``ModuleList`` of same-class modules with parameters in the vision tower (the first of equals)."""
    best, length = None, 0
    for name, module in model.get_submodule(vision).named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) <= length:
            continue
        if len({type(entry) for entry in module}) == 1 and any(True for _ in module.parameters()):
            best, length = f"{vision}.{name}", len(module)
    return best


def _projector(model: nn.Module, vision: str, language: str, blocks: str) -> tuple[str, ...]:
    """The projector's modules: the parent's children besides the two towers, else the tower's after its blocks."""
    parent = vision.rpartition(".")[0]
    found = [
        f"{parent}.{name}".lstrip(".")
        for name, child in model.get_submodule(parent).named_children()
        if f"{parent}.{name}".lstrip(".") not in (vision, language) and _holds_parameters(child)
    ]
    found = [path for path in found if path != _head_path(model)]
    if not found:
        after, seen = [], False
        top = blocks.removeprefix(f"{vision}.").partition(".")[0]
        for name, child in model.get_submodule(vision).named_children():
            if seen and _holds_parameters(child):
                after.append(f"{vision}.{name}")
            seen = seen or name == top
        found = after
    units: list[str] = []
    for path in found:  # a list of projectors has no forward of its own: each entry is one
        module = model.get_submodule(path)
        units += [f"{path}.{i}" for i in range(len(module))] if isinstance(module, nn.ModuleList) else [path]
    return tuple(units)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _head_path(model: nn.Module) -> str | None:
    """The output head's name (a model whose towers sit at its top level holds the head next to them)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return next((name for name, module in model.named_modules() if module is head), None)


def refused_image_text_family(config: Any | None) -> str | None:
    """Why an image-text config's family cannot be parallelized (``None`` where nothing refuses it).

    Llama 4: its multimodal forward fails in the transformers this runs with (every call with ``return_dict`` reads
    ``image_outputs`` from its language model's output, which has none), so no layout can match one process. Gemma 4
    is not refused: in float64 (no float32 step inside the model) FSDP2 and TP match one process to 3e-13, and its
    float32 parity holds at the usual tolerance once its full-attention heads are as narrow as the tiny configs' others
    (a 512-wide head with Gemma 4's unscaled attention makes a random model's float32 gradients accurate to ~1e-5 only,
    one process's included: ``tests/tiny_vlm.py``). With per-layer inputs it is refused under some layouts only
    (:func:`refused_image_text_split`).
    """
    if getattr(config, "vision_config", None) is None:
        return None
    if getattr(config, "model_type", None) == "llama4":
        import transformers

        return (
            f"Llama 4 (model type 'llama4') cannot run: its multimodal forward fails in transformers"
            f" {transformers.__version__} (Llama4ForConditionalGeneration.forward reads `image_outputs` from its"
            " language model's output, which has none), so no layout can be checked against one process"
        )
    return None


def refused_image_text_split(layout: Any, config: Any | None) -> str | None:
    """Why ``layout`` cannot split an image-text family that runs under others (``None`` where nothing refuses it).

    Gemma 4 with per-layer inputs (its text config's ``hidden_size_per_layer_input`` > 0, the default) runs under
    FSDP2 (its parity test), but its multimodal forward reads the padding row of the language model's embedding weight
    outside any module's forward, which tensor parallelism holds vocab-sharded (the forward fails mixing a tensor with
    a DTensor), and computes the per-layer inputs from whole rows of token ids, while context parallelism hands the
    decoder its shard of each row (the forward fails on their shapes). Pipeline stages refuse it by their own check
    (they do not carry ``per_layer_inputs`` to the decoder).
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    if getattr(config, "model_type", None) != "gemma4" or not getattr(text, "hidden_size_per_layer_input", 0):
        return None
    why = {
        "tp_size": "reads the padding row of the language model's embedding weight outside any module's forward, which"
        " tensor parallelism holds vocab-sharded (the forward fails mixing a tensor with a DTensor)",
        "cp_size": "computes the per-layer inputs from whole rows of token ids outside the decoder, which context"
        " parallelism hands its shard of each row (the forward fails on their shapes)",
    }
    split = [name for name in why if getattr(layout, name, 1) > 1]
    if not split:
        return None
    sizes = ", ".join(f"{name}={getattr(layout, name)}" for name in split)
    return (
        f"Gemma 4 with per-layer inputs (model type 'gemma4', text_config.hidden_size_per_layer_input="
        f"{text.hidden_size_per_layer_input}) is not supported with {sizes}: its multimodal forward "
        + "; and it ".join(why[name] for name in split)
        + ". It runs under FSDP2 (dp_shard_size); use that, or a Gemma 4 without per-layer inputs"
        " (hidden_size_per_layer_input=0), which runs under FSDP2, TP and CP."
    )


def check_image_text_layout(layout: Any, config: Any | None) -> None:
    """Refuse, for an image-text model's config, a family that no layout can run (:func:`refused_image_text_family`)
    and a layout that cannot split a family that others run (:func:`refused_image_text_split`); every layout composes
    for the others, as for a text decoder.

    Tensor parallelism splits the language model and replicates the vision tower (its input and output whole on every
    rank; sequence parallelism stays off, the image embeddings are placed into a whole sequence). Context parallelism
    places the images into the whole sequence before it is sharded
    (:mod:`lightning_plugins.parallel.image_text_context`); expert parallelism splits the language model's experts,
    every token staying where it is. Pipeline parallelism keeps the vision tower and the projector in the first stage,
    which places the images into the embeddings (:mod:`lightning_plugins.parallel.pipeline.image_text`): with tensor
    parallelism the first stage's tensor-parallel ranks run the replicated tower on the same images; with context
    parallelism the first stage's model shards the sequence once its images are placed and the later stages take their
    shard of the positions. (Training the text decoder of a multimodal checkpoint alone,
    :mod:`lightning_plugins.checkpoint.text_tower`, builds it from the text config, not refused.)

    Raises:
        LayoutError: naming the refused family and the reason.
    """
    if (why := refused_image_text_family(config)) is not None:
        raise LayoutError(f"{why}. Not supported yet for image-text models under any layout.")
    if (why := refused_image_text_split(layout, config)) is not None:  # Gemma 4 with per-layer inputs under TP or CP
        raise LayoutError(why)


def language_config(config: Any) -> Any:
    """The config of the decoder a layout splits: an image-text config's text config, any other config itself."""
    if getattr(config, "vision_config", None) is None or not hasattr(config, "get_text_config"):
        return config
    return config.get_text_config(decoder=True)
