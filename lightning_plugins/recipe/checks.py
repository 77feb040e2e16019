"""The checks of a recipe that need more than one section: its paths resolved, the layout against the world and
the model's config, the batch arithmetic, what the export can do. Each raises one :class:`RecipeError` naming the
file, the key and a fix (:func:`lightning_plugins.recipe.schema.load_recipe` runs them all)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_plugins.errors import LayoutError, OptionsError, RecipeError
from lightning_plugins.recipe.levers import check_levers

if TYPE_CHECKING:
    from lightning_plugins.parallel.layout import ParallelLayout
    from lightning_plugins.recipe.schema import Recipe

#: What a model.path that names a file ends with (a hub id like ``meta-llama/Llama-3.1-8B`` may hold dots).
_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".yaml", ".yml", ".gguf")


def near_directories(name: str, base: Path) -> str:
    """`` Did you mean ...?`` naming the directories next to the recipe or in the current directory whose names are
    close to ``name`` (``modle`` -> ``model``), or ``""``."""
    found = {p.name: p for folder in (base, Path.cwd()) if folder.is_dir() for p in folder.iterdir() if p.is_dir()}
    near = difflib.get_close_matches(name, list(found), n=3, cutoff=0.6)
    return f" Did you mean {' or '.join(str(found[n]) for n in near)}?" if near else ""


def resolve_paths(recipe: Recipe, path: Path) -> Recipe:
    """``recipe`` with its data files and a local ``model.path`` made absolute (relative to the recipe file, else to
    the current directory)."""
    base = path.resolve().parent
    try:
        data = recipe.data.resolve(base)
    except ValueError as err:
        raise RecipeError(f"{path}: {err}") from None
    model_path = recipe.model.path
    # Relative to the recipe (what the file says), else to the current directory (what an override says).
    local = next((c for c in (base / model_path, Path(model_path).expanduser()) if c.is_dir()), base / model_path)
    if local.is_dir():
        model_path = str(local.resolve())
    elif model_path.startswith((".", "/", "~")) or local.suffix in _FILE_SUFFIXES or model_path.count("/") > 1:
        raise RecipeError(
            f"{path}: model.path={recipe.model.path!r} is not a directory (looked for {local}).{near_directories(local.name, base)}"
            " Give a local HF checkpoint directory (config.json + *.safetensors + tokenizer), relative to the recipe,"
            " or a hub id."
        )
    return recipe.model_copy(update={"data": data, "model": recipe.model.model_copy(update={"path": model_path})})


def check_recipe(recipe: Recipe, path: Path) -> Recipe:
    """``recipe`` with its layout resolved for the world, once every check that spans sections has passed."""
    world = recipe.hardware.world_size
    try:
        layout = recipe.layout.resolve(world)
    except LayoutError as err:
        raise RecipeError(
            f"{path}: layout does not fit hardware.devices x hardware.nodes = {world} processes: {err}"
        ) from None
    config = _config_of(recipe, path)
    if config is not None:
        _check_against_the_model(recipe, layout, config, path)
    recipe = recipe.model_copy(update={"layout": layout})
    _check_batch(recipe, layout, path)
    check_levers(recipe, path)
    if layout.pp_size > 1:
        _check_pipeline_batch(recipe, layout, path)
    if recipe.data.packing and layout.cp_size == 1:  # context-parallel attention keeps the documents apart itself
        _check_packing_attention(recipe, path)
    _check_merged_export(recipe, path)
    _check_objective(recipe, layout, path)
    from lightning_plugins.recipe.image_text import check_image_text_recipe

    check_image_text_recipe(recipe, path)
    return recipe


def _check_packing_attention(recipe: Recipe, path: Path) -> None:
    """Packed rows with an attention that keeps their samples apart: sdpa, eager, flex, or flash attention 2/3 given the
    samples' lengths (:func:`~lightning_plugins.recipe.build.varlen_packing`; a pipeline's stages find them from the
    positions). Whether flash attention runs on this machine (CUDA) is the preflight's check."""
    from lightning_plugins.data import check_packing_attention

    try:
        check_packing_attention(recipe.model.attn_implementation, varlen=True)
    except ValueError as err:
        raise RecipeError(f"{path}: model.attn_implementation with data.packing: {err}") from None


def _check_objective(recipe: Recipe, layout: ParallelLayout, path: Path) -> None:
    """A preference method on what this slice of it covers: pairs (dpo, simpo, orpo; padded, or packed whole pairs
    per row but for PP and a precomputed reference) or unpaired examples (kto, padded), layouts whose sequence
    log-probabilities are summed exactly (FSDP2, HSDP, TP with SP and loss parallel, CP ring and Ulysses, EP, PP).
    DPO's reference is the base with the adapters disabled under LoRA, else a frozen copy of the model laid out like
    it (split into the same stages under PP), or precomputed in one pass before training."""
    objective = recipe.objective
    if objective.method == "sft":
        if recipe.data.format in ("preference", "unpaired"):
            raise RecipeError(f"{path}: data.format: {recipe.data.format} trains a preference method; set"
                              " objective.method (dpo, simpo, orpo on pairs, kto on unpaired records), or give"
                              " prompt/completion or chat records for SFT.")  # fmt: skip
        return
    key = f"objective.method={objective.method}"
    fmt = "unpaired" if objective.unpaired else "preference"
    what = "unpaired prompt/completion/label records" if objective.unpaired else "chosen/rejected pairs"
    if recipe.data.format not in ("auto", fmt):
        raise RecipeError(f"{path}: {key} trains on {what}; set data.format: {fmt} (or auto).")
    if recipe.data.packing and objective.unpaired:  # pairs pack whole per row (data.packing.collate_packed_pairs)
        raise RecipeError(f"{path}: {key}: preference records are not packed yet; set data.packing: false.")
    if recipe.data.packing and (layout.pp_size > 1 or objective.reference == "precomputed"):
        why = (f"under pipeline parallelism (layout.pp_size={layout.pp_size})" if layout.pp_size > 1 else
               "with objective.reference: precomputed")  # fmt: skip
        raise RecipeError(f"{path}: {key}: packed preference pairs do not train {why} yet; set data.packing: false.")
    _check_reference_source(recipe, layout, path)


def _check_reference_source(recipe: Recipe, layout: ParallelLayout, path: Path) -> None:
    """``objective.reference: precomputed``: for the DPO family (paired, with a reference), not under PP."""
    objective = recipe.objective
    if objective.reference != "precomputed":
        return
    key = f"objective.method={objective.method}"
    if not objective.needs_reference:
        raise RecipeError(f"{path}: objective.reference: precomputed, but {key} has no reference model; remove"
                          " objective.reference.")  # fmt: skip
    if objective.unpaired:
        raise RecipeError(
            f"{path}: objective.reference: precomputed is for dpo: {key}'s KL rows pair each example with another one"
            " of its micro-batch, which the shuffle changes every epoch, so their reference values cannot be computed"
            " once. Use objective.reference: model."
        )
    if layout.pp_size > 1:
        raise RecipeError(
            f"{path}: objective.reference: precomputed does not run under pipeline parallelism yet (layout.pp_size="
            f"{layout.pp_size}); use objective.reference: model (the base with the adapters disabled), or pp_size: 1."
        )


def _config_of(recipe: Recipe, path: Path) -> Any:
    """The model's transformers config (``None`` for a hub id whose config is not at hand)."""
    try:
        return model_config(recipe.model.path, recipe.model.trust_remote_code)
    except (ValueError, OSError) as err:
        if "trust_remote_code" in str(err):
            raise RecipeError(
                f"{path}: model.path={recipe.model.path!r} ships its own Python code (config.json's auto_map), which"
                " runs only with model.trust_remote_code: true. Set it if you have read that code and trust it."
            ) from None
        raise RecipeError(
            f"{path}: model.path={recipe.model.path!r} is a directory but not a transformers model ({err}). Point"
            " model.path at an HF checkpoint directory (config.json, tokenizer and weights) or a hub id."
        ) from None


def _check_against_the_model(recipe: Recipe, layout: ParallelLayout, config: Any, path: Path) -> None:
    """The layout and options, the LoRA targets and the weights' format against the model's config."""
    from lightning_plugins.parallel.checks import check_settings

    try:
        check_settings(layout, recipe.parallel, recipe.memory, config)
        if layout.tp_size > 1:
            _check_tensor_plan(config)
    except (LayoutError, OptionsError) as err:
        raise RecipeError(f"{path}: layout/parallel do not fit model {recipe.model.path}: {err}") from None
    if recipe.lora is not None:
        from lightning_plugins.adapters.lora import check_lora_targets
        from lightning_plugins.data.image_dataset import is_image_text_data

        if is_image_text_data(recipe.data):  # the adapters go onto the whole image-text model
            config = model_config(recipe.model.path, recipe.model.trust_remote_code, multimodal=True) or config
        try:
            check_lora_targets(config, recipe.lora)
        except OptionsError as err:
            raise RecipeError(f"{path}: lora: {err}") from None
    from lightning_plugins.checkpoint.mxfp4 import check_mxfp4
    from lightning_plugins.errors import CheckpointError
    from lightning_plugins.parallel.dtypes import DTYPES

    try:
        check_mxfp4(config, DTYPES[recipe.model.dtype], recipe.lora.quantize if recipe.lora else "none")
    except CheckpointError as err:
        raise RecipeError(f"{path}: model {recipe.model.path}: {err}") from None


def _check_batch(recipe: Recipe, layout: ParallelLayout, path: Path) -> None:
    """The global batch divides into micro-batches over the data ranks."""
    per_step = recipe.train.micro_batch_size * layout.dp_size
    if recipe.samples_per_step % per_step:
        good = max(per_step, recipe.samples_per_step // per_step * per_step)
        raise RecipeError(
            f"{path}: train.global_batch_size={recipe.samples_per_step} is not a multiple of train.micro_batch_size"
            f" ({recipe.train.micro_batch_size}) x data-parallel ranks ({layout.dp_size}) = {per_step}. Use"
            f" train.global_batch_size={good}, or change train.micro_batch_size."
        )


def _check_pipeline_batch(recipe: Recipe, layout: ParallelLayout, path: Path) -> None:
    """A micro-batch divides into the pipeline's micro-batches."""
    from lightning_plugins.parallel.pipeline import PipelineOptions

    micro = PipelineOptions.of(recipe.parallel).resolve(layout.pp_size).microbatches
    if recipe.train.micro_batch_size % micro:
        raise RecipeError(
            f"{path}: train.micro_batch_size={recipe.train.micro_batch_size} must divide into"
            f" parallel.pp_microbatches={micro} pipeline micro-batches. Use train.micro_batch_size="
            f"{micro * max(1, recipe.train.micro_batch_size // micro)}."
        )


def _check_merged_export(recipe: Recipe, path: Path) -> None:
    """``train.merge_lora`` needs LoRA adapters on dense linear layers only."""
    if recipe.lora is None and recipe.train.merge_lora:
        raise RecipeError(
            f"{path}: train.merge_lora is set but the recipe has no lora section. Remove it or add lora:."
        )
    if recipe.lora is not None and recipe.lora.quantize == "nf4" and recipe.train.merge_lora:
        raise RecipeError(
            f"{path}: train.merge_lora with lora.quantize: nf4: merging needs dense base weights. Export the adapter"
            " (the default), then merge it into the dense base in one process: PeftModel.from_pretrained(base,"
            " adapter_dir).merge_and_unload()."
        )
    unmerged = [key for key in ("target_parameters", "modules_to_save") if recipe.lora and getattr(recipe.lora, key)]
    if unmerged and recipe.train.merge_lora:
        raise RecipeError(
            f"{path}: train.merge_lora with lora.{unmerged[0]}: the merged export merges LoRA on linear layers only."
            " Export the adapter (the default; it holds the expert adapters and trained modules), then merge it in one"
            " process: PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()."
        )


def _check_tensor_plan(config: Any) -> None:
    """The model's family (or its config's ``base_model_tp_plan``) says how to split it; the fallback's notice is
    given when the model is parallelized, not here as well."""
    import types
    import warnings

    from lightning_plugins.parallel.families import family_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        family_for(types.SimpleNamespace(config=config), tensor_parallel=True)


def model_config(model_path: str, trust_remote_code: bool = False, *, multimodal: bool = False) -> Any:
    """The transformers config of a local checkpoint, or of a hub id whose config is shipped under
    ``recipes/configs`` (``meta-llama/Llama-3.1-70B``) or cached locally; ``None`` for another hub id (checked
    when it is loaded); a multimodal checkpoint's is its text decoder's (the model a text recipe trains), or with
    ``multimodal`` the whole (an image-text recipe's)."""
    if Path(model_path).is_dir():
        from transformers import AutoConfig

        from lightning_plugins.checkpoint.text_tower import text_config

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        return config if multimodal else text_config(config)
    from lightning_plugins.planner.model_stats import load_model_config
    from lightning_plugins.errors import PlannerError

    try:
        return load_model_config(model_path, multimodal=multimodal)
    except PlannerError:
        return None
