"""What the planner plans: a model config, a layout with its settings, and the batch shapes of one step.

A :class:`Workload` is made from a recipe (:meth:`Workload.from_recipe`) or by the search; the dry run,
the step-time model and the report all read the same object, so a setting is defined once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.errors import LayoutError, OptionsError
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.errors import PlannerError
from lightning_plugins.parallel.image_text import check_image_text_layout
from lightning_plugins.planner.image_text import ImageInputs
from lightning_plugins.preference.options import PreferenceOptions


@dataclass(frozen=True)
class Workload:
    """One training step of a model under a layout.

    Args:
        config: The transformers config of the model (real size).
        layout: A resolved :class:`ParallelLayout` (its world size is the number of GPUs).
        options: How the layout is applied (sequence/loss parallel, CP backend, pipeline schedule).
        memory: Activation checkpointing, FSDP2 dtypes, CPU offload.
        lora: LoRA settings (``quantize="nf4"`` for QLoRA), or ``None`` for a full fine-tune.
        dtype: The weights' dtype (``"bf16"``, ``"fp32"``); FSDP2's ``memory.param_dtype`` is the compute dtype.
        seq_len: Tokens per row.
        micro_batch_size: Rows per data rank per forward (under pipeline parallelism: the batch the
            pipeline splits into ``options.pp_microbatches`` micro-batches), as in a recipe.
        global_batch_size: Rows per optimizer step over all data ranks.
        attn_implementation: transformers' attention implementation the run uses.
        optimizer: ``optim.name`` of the recipe: ``adamw`` (fp32 moments) or ``adamw8bit`` (8-bit moments).
        objective: What the step optimizes (the recipe's ``objective:``): SFT, or a preference method, whose step
            runs :class:`~lightning_plugins.preference.PreferenceObjective` (DPO: a no-grad forward of the reference,
            the base with the adapters disabled, before the policy's). ``micro_batch_size`` and
            ``global_batch_size`` count rows then: a pair is two (:meth:`from_recipe` doubles the recipe's pairs).
        packed_pairs: A preference recipe with ``data.packing``: its rows hold whole pairs side by side, so
            ``micro_batch_size`` and ``global_batch_size`` count packed rows, as the recipe's do (the measured step:
            :func:`~lightning_plugins.data.packing.pairs_in_rows`, one pair a row).
        images: For an image-text recipe (its data holds images): the whole model's config and the images of the
            measured step (:class:`~lightning_plugins.planner.image_text.ImageInputs`); ``config`` is then its text
            decoder's. ``None``: a text model (or the text decoder of an image-text checkpoint) on text rows.
    """

    config: Any
    layout: ParallelLayout
    options: ParallelOptions = field(default_factory=ParallelOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    lora: LoraOptions | None = None
    dtype: str = "bf16"
    seq_len: int = 4096
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    attn_implementation: str = "sdpa"
    optimizer: str = "adamw"
    objective: PreferenceOptions = field(default_factory=PreferenceOptions)
    packed_pairs: bool = False
    images: ImageInputs | None = None

    def __post_init__(self) -> None:
        if self.layout.dp_shard_size == -1:
            raise PlannerError("Workload needs a resolved layout: call `layout.resolve(world_size)` first.")
        try:
            check_settings(self.layout, self.options, self.memory, self.config)
            if self.images is not None:
                check_image_text_layout(self.layout, self.images.config)
        except (LayoutError, OptionsError) as err:
            raise PlannerError(str(err)) from None
        if self.global_batch_size is None:
            object.__setattr__(self, "global_batch_size", self.micro_batch_size * self.layout.dp_size)

    @property
    def method(self) -> str:
        """``"full"``, ``"lora"`` or ``"qlora"``."""
        if self.lora is None:
            return "full"
        return "qlora" if self.lora.quantize == "nf4" else "lora"

    @property
    def rows_per_sample(self) -> int:
        """Rows one sample of a recipe's batch sizes becomes: 2 for a preference pair (chosen, rejected), else 1 (a
        row, or a packed row of pairs)."""
        return 2 if self.objective.paired and not self.packed_pairs else 1

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def pipeline(self) -> Any:
        """The resolved pipeline options (schedule, micro-batches, stages per rank), or ``None`` without PP."""
        if self.layout.pp_size == 1:
            return None
        from lightning_plugins.parallel.pipeline import PipelineOptions

        return PipelineOptions.of(self.options).resolve(self.layout.pp_size, self.config.num_hidden_layers)

    def with_layers(self, num_layers: int) -> Workload:
        """The same workload on a copy of the model config with ``num_layers`` decoder layers."""
        config = self.config.__class__.from_dict(self.config.to_dict())
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
        return replace(self, config=config)

    @classmethod
    def from_recipe(cls, recipe: Any, config: Any | None = None) -> Workload:
        """The workload of a loaded recipe (:func:`lightning_plugins.recipe.schema.load_recipe`) at its real size."""
        if config is None:
            from lightning_plugins.planner.model_stats import load_model_config

            config = load_model_config(recipe.model.path)
        from lightning_plugins.data.image_dataset import is_image_text_data

        packed_pairs = recipe.objective.paired and recipe.data.packing
        rows = 2 if recipe.objective.paired and not packed_pairs else 1  # a pair: its chosen row and its rejected row
        images = ImageInputs.of(recipe.model.path, recipe.vision) if is_image_text_data(recipe.data) else None
        return cls(
            config=config,
            layout=recipe.layout.resolve(recipe.hardware.world_size),
            options=recipe.parallel,
            memory=recipe.memory,
            lora=recipe.lora,
            dtype=recipe.model.dtype,
            seq_len=recipe.data.max_seq_len,
            micro_batch_size=recipe.train.micro_batch_size * rows,
            global_batch_size=recipe.samples_per_step * rows,
            attn_implementation=recipe.model.attn_implementation,
            optimizer=recipe.optim.name,
            objective=recipe.objective,
            packed_pairs=packed_pairs,
            images=images,
        )
