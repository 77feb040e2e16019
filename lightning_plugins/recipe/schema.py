"""The recipe: one YAML file that says what to fine-tune, on what data, with which layout and settings.

Parsed by pydantic into typed sections. The ``layout``, ``parallel``, ``memory``, ``data`` and ``lora``
sections *are* the engine's own objects (:class:`~lightning_plugins.ParallelLayout`,
:class:`~lightning_plugins.ParallelOptions`, :class:`~lightning_plugins.MemoryOptions`,
:class:`~lightning_plugins.data.DataConfig`, :class:`~lightning_plugins.adapters.lora.LoraOptions`), so a setting
is defined once and reaches every door. Nothing here is Lightning- or Accelerate-specific.

Every problem is reported before any process starts, as one :class:`RecipeError` naming the file, the
key path and a fix: unknown keys (with the closest valid key), wrong types, missing files, a layout that does
not divide the world or the model, tensor parallelism on a family without a TP plan, a micro-batch that does not
divide the global batch. What depends on the machine the run starts on is checked by
:mod:`lightning_plugins.recipe.preflight`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lightning_plugins.data import DataConfig
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.errors import LayoutError, OptionsError, RecipeError
from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.recipe.levers import check_levers
from lightning_plugins.resources import find_recipe
from lightning_plugins.run.perf import ProfileOptions


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """What to fine-tune.

    Attributes:
        path: A local HF checkpoint directory (relative to the recipe file) or a hub id.
        dtype: Parameter dtype (``fp32`` on CPU; ``bf16`` on GPUs, with ``memory.param_dtype`` for FSDP2).
        attn_implementation: transformers' attention (``sdpa``, ``eager``, ``flash_attention_2``, ...).
        trust_remote_code: Run the Python code a hub model ships for its config, tokenizer and model. Off by
            default: only turn it on for a model whose code you have read.
    """

    path: str
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False


class OptimSection(_Section):
    """AdamW (``name``: torch's ``adamw``, or torchao's ``adamw8bit``: 8-bit moments) with linear warmup and a decay.

    Attributes:
        lr: Peak learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
        scheduler: ``cosine``, ``linear`` (decay to ``min_lr_ratio * lr`` at the last step) or ``constant``.
        warmup_steps: Linear warmup from 0 to ``lr``.
        min_lr_ratio: The final learning rate as a fraction of ``lr``.
        max_grad_norm: Clip the global gradient norm to this; ``null`` for no clipping.
        name: ``adamw`` (torch's) or ``adamw8bit`` (torchao's 8-bit AdamW: 2 bytes of state per parameter, not 8).
    """

    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    name: Literal["adamw", "adamw8bit"] = "adamw"


def _known_names(names: list[str], known: Sequence[str], kind: str, case: Callable[[str], str]) -> list[str]:
    """``names`` if each is one of ``known``; else the first unknown one named, with the closest known one."""
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(case(name), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"unknown {kind} {name!r}: {hint}use some of {', '.join(known)}")
    return names


class TrainSection(_Section):
    """How long, in what batches, and where the results go.

    Attributes:
        global_batch_size: Samples (packed rows with ``data.packing``) per optimizer step over all data
            ranks; or give ``global_batch_tokens`` instead.
        global_batch_tokens: Tokens per optimizer step (``global_batch_tokens / data.max_seq_len`` rows).
        micro_batch_size: Samples per data-parallel rank per forward (under pipeline parallelism the
            batch the pipeline splits into ``parallel.pp_microbatches``).
        max_steps: Optimizer steps; or ``epochs``.
        epochs: Passes over the training data (when ``max_steps`` is not given).
        eval_every: Evaluate on the held-out split every N optimizer steps (``null``: at each epoch end).
        checkpoint_every: Write a distributed checkpoint every N optimizer steps (``null``: none).
        async_checkpoint: Write checkpoints in the background while training goes on (DCP's async save); each is
            moved into place only once complete, and the last one is waited for before the run ends.
        log_every: Log loss, learning rate, gradient norm and tokens/s every N optimizer steps.
        seed: Seed of weights that are created (LoRA), data order and dropout.
        output_dir: Checkpoints, metrics, the loss curve and the exported model (relative to the
            current directory).
        merge_lora: With LoRA: also export the adapters merged into full weights.
        collective_timeout_s: How long any collective waits for its peers before it fails (the process group's
            timeout, in seconds). A rank that dies ends the job at once; one that hangs ends it after this long,
            with a message naming the rank. Raise it if a step, a checkpoint save or the first load may
            legitimately keep one rank away from the others longer.
        on_nonfinite: What a NaN or infinite loss or gradient norm on any rank does: ``stop`` ends the run with an
            error naming the step, the quantity, the ranks and the last checkpoint; ``skip`` skips that optimizer
            step as AMP's grad scaler does (no update; the learning-rate schedule goes on).
        max_skipped_steps: With ``on_nonfinite: skip``, stop after this many consecutive skipped steps.
        resume_reset_optimizer: On a resume whose ``optim`` settings differ from the checkpoint's, load the weights,
            step and data position but rebuild AdamW's state and the schedule from the new settings (the doors'
            ``--resume-reset-optimizer``; without it such a resume is refused: see :mod:`lightning_plugins.recipe.diff`).
        preempt_signals: The signals that preempt the run (to the launcher or the whole process group): every rank
            finishes its optimizer step, writes ``checkpoints/step=N.ckpt`` and exits non-zero (the ranks with status
            75); a SLURM job requeues itself (:mod:`lightning_plugins.run.preemption`). ``[]``: none (Ctrl-C never is one;
            a worker whose launcher is gone stops so in any case).
        loggers: Where the metrics and the hyperparameters (the resolved recipe, flat dotted keys) go, on rank 0:
            some of ``csv``, ``tensorboard`` (``output_dir/tensorboard``), ``wandb`` (its files in ``output_dir``),
            ``mlflow`` (``MLFLOW_TRACKING_URI``, else a file store in ``output_dir/mlruns``), through Lightning's
            loggers and Accelerate's trackers with the same metric names. CSV (``output_dir/logs``) is written
            whatever the list says: ``metrics.csv`` and the loss curve are built from it.
        project: The wandb project and MLflow experiment (default: the output directory's name); each attempt is
            a run of its own, named ``version_N`` as its CSV directory.
        wandb_offline: Keep wandb's run on disk only (as ``WANDB_MODE=offline`` does); ``wandb sync`` uploads it.
        profile: ``{start_step: N, steps: K}``: ``torch.profiler`` over optimizer steps N..N+K-1 on every rank, a
            Chrome trace per rank in ``output_dir/profile/`` and, printed by rank 0 and in ``profile/summary.json``,
            where each rank's time went (compute, communication by collective, exposed communication, data wait,
            idle; :mod:`lightning_plugins.run.perf`). ``null``: off.
        perf_sample: Profile the last optimizer step of every ``log_every`` window to log each rank's step, own and
            data-wait time, the slowest rank and its ratio to the median (``perf/*`` metrics,
            ``output_dir/ranks.jsonl``). Each sampled step costs the profiler's recording and reading (about 0.1 s per
            step of the tiny TP recipe, whose steps take about as long; a real model's fewer, longer ops cost less in
            proportion), plus about a second for the profiler's first start in each process.
        straggler_ratio: Rank 0 prints a line naming the slowest rank when its own time (its step less the time it
            waited on its peers) is at least this many times the median (and 50 ms more: not a hiccup).
    """

    global_batch_size: int | None = Field(None, ge=1)
    global_batch_tokens: int | None = Field(None, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    epochs: int | None = Field(None, ge=1)
    eval_every: int | None = Field(None, ge=1)
    checkpoint_every: int | None = Field(None, ge=1)
    async_checkpoint: bool = False
    log_every: int = Field(10, ge=1)
    seed: int = 0
    output_dir: str = "outputs/finetune"
    merge_lora: bool = False
    collective_timeout_s: float = Field(1800.0, gt=0)
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_skipped_steps: int = Field(10, ge=1)
    resume_reset_optimizer: bool = False
    preempt_signals: list[str] = Field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    loggers: list[str] = Field(default_factory=lambda: ["csv"])
    project: str | None = None
    wandb_offline: bool = False
    profile: ProfileOptions | None = None
    perf_sample: bool = True
    straggler_ratio: float = Field(1.25, gt=1)

    @field_validator("preempt_signals")
    @classmethod
    def _known_signals(cls, names: list[str]) -> list[str]:
        from lightning_plugins.run.preemption import SIGNALS

        return _known_names(names, SIGNALS, "signal", str.upper)

    @field_validator("loggers")
    @classmethod
    def _known_loggers(cls, names: list[str]) -> list[str]:
        from lightning_plugins.recipe.record import LOGGERS

        return _known_names(names, LOGGERS, "logger", str.lower)

    @model_validator(mode="after")
    def _one_of_each(self) -> TrainSection:
        if (self.global_batch_size is None) == (self.global_batch_tokens is None):
            raise ValueError("give exactly one of global_batch_size (samples) and global_batch_tokens")
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of max_steps and epochs")
        if self.profile is not None and self.max_steps is not None:
            self.profile.check_within(self.max_steps)
        return self


class HardwareSection(_Section):
    """Where it runs. ``devices`` x ``nodes`` processes make the world the layout must fill.

    Attributes:
        accelerator: ``cpu``, ``gpu`` or ``auto``.
        devices, nodes: Processes (GPUs) per node, and nodes.
        gpu: The GPU model ``lightning-plugins plan`` checks against: memory, FLOP/s, links (``H100``, ``A100``, ...).
        gpu_memory_gb, host_memory_gb: Memory of one GPU, and host RAM of one node (loading and training checked
            against it), in GiB, when they differ from the GPU model's and its usual node's (8 x H100: 2 TiB).
    """

    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    devices: int = Field(1, ge=1)
    nodes: int = Field(1, ge=1)
    gpu: str | None = None
    gpu_memory_gb: float | None = Field(None, gt=0)
    host_memory_gb: float | None = Field(None, gt=0)

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes


class Recipe(_Section):
    """A whole recipe. Build it with :func:`load_recipe`, which resolves paths and checks everything."""

    model: ModelSection
    data: DataConfig
    layout: ParallelLayout = ParallelLayout()
    parallel: ParallelOptions = Field(default_factory=ParallelOptions)
    memory: MemoryOptions = Field(default_factory=MemoryOptions)
    lora: LoraOptions | None = None
    optim: OptimSection = Field(default_factory=OptimSection)
    train: TrainSection
    hardware: HardwareSection = Field(default_factory=HardwareSection)

    @property
    def samples_per_step(self) -> int:
        """Rows per optimizer step over all data ranks."""
        if self.train.global_batch_size is not None:
            return self.train.global_batch_size
        return max(1, self.train.global_batch_tokens // self.data.max_seq_len)

    @property
    def accumulation(self) -> int:
        """Micro-batches each data rank accumulates per optimizer step."""
        return self.samples_per_step // (self.train.micro_batch_size * self.layout.dp_size)

    def to_yaml(self) -> str:
        """The resolved recipe as YAML (what ``--print-config`` shows)."""
        return yaml.safe_dump(json.loads(self.model_dump_json()), sort_keys=False)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override, validate and resolve a recipe; check it against the model config and the world.

    Args:
        path: The YAML file, or a shipped recipe's id (``llama-3.1-8b/lora_1gpu``; ``lightning-plugins recipes``).
        overrides: Dotted ``key=value`` settings applied before validation (``lora.r=32``,
            ``train.max_steps=200``); values are parsed as YAML (``true``, ``1e-4``, ``[q_proj, v_proj]``).

    Raises:
        RecipeError: naming the file, the key path and a fix; nothing has started yet.
    """
    path = find_recipe(path)  # a file, or a shipped recipe's id
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise RecipeError(
            f"{path}: a recipe is a mapping of sections (model, data, layout, ...), got {type(raw).__name__}."
        )
    for override in overrides:
        apply_override(raw, override, path)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as err:
        raise RecipeError(_describe(err, path)) from None
    return _check(_resolve_paths(recipe, path), path)


def apply_override(raw: dict, override: str, path: Path) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise RecipeError(f"{path}: override {override!r} is not `section.key=value` (e.g. --lora.r=32).")
    *parents, leaf = key.strip().lstrip("-").split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise RecipeError(f"{path}: override {override!r}: `{part}` is not a section.")
        node = child
    try:
        node[leaf] = yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: override {override!r}: the value is not valid YAML ({err}).") from None


def _describe(err: ValidationError, path: Path) -> str:
    lines = [f"{path}: {err.error_count()} problem(s) in the recipe:"]
    for problem in err.errors():
        key = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            message = f"unknown key; {_closest(problem['loc'])}"
        elif problem["type"] == "missing":
            message = "required key is missing"
        shown = problem.get("input")
        got = "" if problem["type"] == "missing" or isinstance(shown, dict) else f" (got {shown!r})"
        lines.append(f"  {key}: {message}{got}")
    return "\n".join(lines)


def _unwrap(annotation: Any) -> Any:
    """``LoraOptions | None`` -> ``LoraOptions``."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return args[0] if len(args) == 1 else annotation


def _keys_of(section: Any) -> dict[str, Any]:
    """The keys a section (a pydantic model or a dataclass of the engine) takes, with their types."""
    if isinstance(section, type) and issubclass(section, BaseModel):
        return {name: _unwrap(field.annotation) for name, field in section.model_fields.items()}
    if dataclasses.is_dataclass(section):
        types = {field.name: _unwrap(field.type) for field in dataclasses.fields(section)}
        return {name: types.get(name) for name in inspect.signature(section).parameters if not name.startswith("_")}
    return {}


def _closest(loc: tuple[str | int, ...]) -> str:
    """How to fix an unknown key: the closest valid key of its section (difflib), else the section's keys."""
    section: Any = Recipe
    for part in loc[:-1]:
        section = _keys_of(section).get(str(part))
    valid = list(_keys_of(section))
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    where = ".".join(str(part) for part in loc[:-1]) or "the recipe"
    return f"remove it, or use one of the keys of {where}: {', '.join(valid)}"


#: What a model.path that names a file ends with (a hub id like ``meta-llama/Llama-3.1-8B`` may hold dots).
_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".yaml", ".yml", ".gguf")


def near_directories(name: str, base: Path) -> str:
    """`` Did you mean ...?`` naming the directories next to the recipe or in the current directory whose names are
    close to ``name`` (``modle`` -> ``model``), or ``""``."""
    found = {p.name: p for folder in (base, Path.cwd()) if folder.is_dir() for p in folder.iterdir() if p.is_dir()}
    near = difflib.get_close_matches(name, list(found), n=3, cutoff=0.6)
    return f" Did you mean {' or '.join(str(found[n]) for n in near)}?" if near else ""


def _resolve_paths(recipe: Recipe, path: Path) -> Recipe:
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


def _check(recipe: Recipe, path: Path) -> Recipe:
    """The checks that need more than one section: the world, the model config, the batch arithmetic."""
    world = recipe.hardware.world_size
    try:
        layout = recipe.layout.resolve(world)
    except LayoutError as err:
        raise RecipeError(
            f"{path}: layout does not fit hardware.devices x hardware.nodes = {world} processes: {err}"
        ) from None
    try:
        config = _model_config(recipe.model.path, recipe.model.trust_remote_code)
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
    if config is not None:
        from lightning_plugins.parallel.checks import check_settings

        try:
            check_settings(layout, recipe.parallel, recipe.memory, config)
            if layout.tp_size > 1:
                _check_tensor_plan(config)
        except (LayoutError, OptionsError) as err:
            raise RecipeError(f"{path}: layout/parallel do not fit model {recipe.model.path}: {err}") from None
        if recipe.lora is not None:
            from lightning_plugins.adapters.lora import check_lora_targets

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
    recipe = recipe.model_copy(update={"layout": layout})
    per_step = recipe.train.micro_batch_size * layout.dp_size
    if recipe.samples_per_step % per_step:
        good = max(per_step, recipe.samples_per_step // per_step * per_step)
        raise RecipeError(
            f"{path}: train.global_batch_size={recipe.samples_per_step} is not a multiple of train.micro_batch_size"
            f" ({recipe.train.micro_batch_size}) x data-parallel ranks ({layout.dp_size}) = {per_step}. Use"
            f" train.global_batch_size={good}, or change train.micro_batch_size."
        )
    check_levers(recipe, path)
    if layout.pp_size > 1:
        from lightning_plugins.parallel.pipeline import PipelineOptions

        micro = PipelineOptions.of(recipe.parallel).resolve(layout.pp_size).microbatches
        if recipe.train.micro_batch_size % micro:
            raise RecipeError(
                f"{path}: train.micro_batch_size={recipe.train.micro_batch_size} must divide into"
                f" parallel.pp_microbatches={micro} pipeline micro-batches. Use train.micro_batch_size="
                f"{micro * max(1, recipe.train.micro_batch_size // micro)}."
            )
    if recipe.data.packing and layout.cp_size == 1:  # context-parallel attention keeps the documents apart itself
        from lightning_plugins.data import check_packing_attention

        try:
            check_packing_attention(recipe.model.attn_implementation)
        except ValueError as err:
            raise RecipeError(f"{path}: model.attn_implementation with data.packing: {err}") from None
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
    return recipe


def _check_tensor_plan(config: Any) -> None:
    """The model's family (or its config's ``base_model_tp_plan``) says how to split it; the fallback's notice is
    given when the model is parallelized, not here as well."""
    import types
    import warnings

    from lightning_plugins.parallel.families import family_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        family_for(types.SimpleNamespace(config=config), tensor_parallel=True)


def _model_config(model_path: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of a local checkpoint, or of a hub id whose config is shipped under
    ``recipes/configs`` (``meta-llama/Llama-3.1-70B``) or cached locally; ``None`` for another hub id (checked
    when it is loaded); a multimodal checkpoint's is its text decoder's (the model a recipe trains)."""
    if Path(model_path).is_dir():
        from transformers import AutoConfig

        from lightning_plugins.checkpoint.text_tower import text_config

        return text_config(AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code))
    from lightning_plugins.planner.model_stats import load_model_config
    from lightning_plugins.errors import PlannerError

    try:
        return load_model_config(model_path)
    except PlannerError:
        return None
