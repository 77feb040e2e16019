"""Pipeline options and schedules: which torch schedule runs, how many stages and micro-batches, which layers.

:class:`PipelineOptions` resolves the defaults and checks every constraint of a schedule;
:func:`stages_of_rank` and :func:`layer_ranges` say which stages a rank runs and which layers a stage holds;
:func:`check_pipeline_layout` validates the options against a layout and a model config before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_plugins.errors import LayoutError, OptionsError
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.pipeline.anatomy import check_stageable_config
from lightning_plugins.parallel.options import SCHEDULES, ParallelOptions, ScheduleSpec, check_schedule

__all__ = ["SCHEDULES", "PipelineOptions", "check_pipeline_layout", "check_pp_reshard", "layer_ranges", "stages_of_rank"]


@dataclass(frozen=True)
class PipelineOptions:
    """How the pipeline runs: the pipeline fields of :class:`~lightning_plugins.ParallelOptions`, resolved here.

    Build it with :meth:`of` from the ``ParallelOptions`` a user gives (``pp_schedule``, ``pp_microbatches``,
    ``pp_stages_per_rank``); :meth:`resolve` fills in the defaults for a pipeline size and model.

    Args:
        schedule: One of :data:`SCHEDULES` (``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ...).
        microbatches: Micro-batches per step; ``None`` takes the number of stages.
        stages_per_rank: Stages each rank holds; ``None`` takes 1 for single-stage schedules and 2
            for interleaved and V-shaped ones.
    """

    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None

    @classmethod
    def of(cls, options: ParallelOptions) -> PipelineOptions:
        """The pipeline part of ``options`` (unresolved)."""
        return cls(options.pp_schedule, options.pp_microbatches, options.pp_stages_per_rank)

    def resolve(self, pp_size: int, num_layers: int | None = None) -> PipelineOptions:
        """Fill in the defaults and check every constraint.

        Raises:
            OptionsError: for a schedule, stage or micro-batch count that does not fit; LayoutError: for more stages
                than the model has layers; both name the fix.
        """
        name = check_schedule(self.schedule)
        spec = SCHEDULES[name]
        v = self.stages_per_rank if self.stages_per_rank is not None else (2 if spec.multi else 1)
        if not isinstance(v, int) or v < 1:
            raise OptionsError(f"pp_stages_per_rank must be a positive integer, got {v!r}.")
        if not spec.multi and v != 1:
            raise OptionsError(
                f"pp_schedule={name!r} runs one stage per rank, but pp_stages_per_rank={v}. Use pp_stages_per_rank=1,"
                " or an interleaved schedule (e.g. pp_schedule='interleaved_1f1b') for several stages per rank."
            )
        if spec.v_shape and v != 2:
            raise OptionsError(
                f"pp_schedule={name!r} is V-shaped and needs exactly 2 stages per rank, got pp_stages_per_rank={v}."
                " Use pp_stages_per_rank=2."
            )
        if spec.multi and not spec.v_shape and v < 2:
            raise OptionsError(
                f"pp_schedule={name!r} interleaves several stages per rank, but pp_stages_per_rank={v}. Use"
                " pp_stages_per_rank >= 2, or pp_schedule='1f1b' for one stage per rank."
            )
        stages = pp_size * v
        if num_layers is not None and stages > num_layers:
            fewer = num_layers // pp_size
            fix = (
                f"pp_stages_per_rank={fewer}"
                if spec.multi and not spec.v_shape and fewer >= 2
                else "pp_schedule='1f1b' (one stage per rank)"
                if pp_size <= num_layers
                else f"pp_size <= {num_layers}"
            )
            raise LayoutError(
                f"pp_size={pp_size} x pp_stages_per_rank={v} = {stages} pipeline stages, but the model has only"
                f" num_hidden_layers={num_layers}: every stage needs at least one decoder layer. Use {fix}."
            )
        m = self.microbatches if self.microbatches is not None else stages
        if not isinstance(m, int) or m < 1:
            raise OptionsError(f"pp_microbatches must be a positive integer, got {m!r}.")
        if name in ("1f1b", "dualpipev") and m < stages:
            raise OptionsError(
                f"pp_schedule={name!r} needs at least as many micro-batches as pipeline stages: pp_microbatches={m} <"
                f" {stages} stages. Use pp_microbatches >= {stages} (more micro-batches also shrink the bubble)."
            )
        if spec.multi and name != "dualpipev" and (m < pp_size or m % pp_size):
            raise OptionsError(
                f"pp_schedule={name!r} runs micro-batches in rounds of pp_size={pp_size}: pp_microbatches={m} must be a"
                f" positive multiple of {pp_size}. Use e.g. pp_microbatches={max(1, m // pp_size) * pp_size}."
            )
        return replace(self, schedule=name, microbatches=m, stages_per_rank=v)

    @property
    def spec(self) -> ScheduleSpec:
        return SCHEDULES[self.schedule]


def stages_of_rank(pp_rank: int, pp_size: int, options: PipelineOptions) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` runs (looped: r, r+p, ...; V-shaped: r and 2p-1-r)."""
    if options.spec.v_shape:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(options.stages_per_rank or 1)]


def layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges per stage; the first ``num_layers % num_stages`` stages get one more.

    The last stage, which also runs the final norm, ``lm_head`` and the loss, is never the larger one.
    """
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def check_pipeline_layout(
    layout: ParallelLayout, config: Any, options: PipelineOptions, tied: bool | None = None
) -> PipelineOptions:
    """Validate ``options`` against a resolved layout and a model config before any collective.

    The config's part of the staging check runs here (attention types, switches); the model's structure is read
    by :func:`~lightning_plugins.parallel.pipeline.anatomy.decoder_anatomy` when the model is there. ``tied``: whether
    the head's weight is the embedding's (``None``: the config's ``tie_word_embeddings``; an image-text model's is its
    whole config's, while ``config`` is its language model's).
    """
    check_stageable_config(config, layout.pp_size)
    resolved = options.resolve(layout.pp_size, getattr(config, "num_hidden_layers", None))
    tied = bool(getattr(config, "tie_word_embeddings", False)) if tied is None else tied
    if tied and resolved.spec.v_shape and layout.fsdp_size > 1:
        raise OptionsError(
            f"pp_schedule={resolved.schedule!r} puts the first and the last stage on one rank, where a tied embedding"
            " would be one parameter in two FSDP2 stage modules. Use pp_schedule='interleaved_1f1b' (or another"
            " looped schedule) for this tied-embedding model with data or context parallelism (FSDP2 shards each"
            " stage over dp_shard_size x cp_size ranks)."
        )
    return resolved


def check_pp_reshard(layout: ParallelLayout, pipeline: PipelineOptions | None, resolved: bool) -> None:
    """``pp_reshard_per_microbatch`` needs stages sharded by FSDP2 and a schedule with one backward pass.

    Raises:
        OptionsError: without pipeline parallelism, under a zero-bubble schedule, or (for a resolved layout) with
            one data rank, naming the fix.
    """
    if pipeline is None:
        raise OptionsError(
            "pp_reshard_per_microbatch applies to pipeline stages: set pp_size > 1, or drop it (without pipeline"
            " parallelism FSDP2 already reshards and reduce-scatters once per backward)."
        )
    if pipeline.spec.split_backward:
        raise OptionsError(
            f"pp_reshard_per_microbatch does not work with pp_schedule={pipeline.schedule!r}: a zero-bubble schedule"
            " computes weight gradients in a later pass and needs the parameters gathered until then. Use"
            " pp_schedule='1f1b' or 'interleaved_1f1b', or drop pp_reshard_per_microbatch."
        )
    if resolved and layout.fsdp_size == 1:
        raise OptionsError(
            "pp_reshard_per_microbatch reshards FSDP2's stage parameters and needs at least 2 data-parallel ranks"
            " (dp_shard_size, dp_replicate_size or cp_size > 1); with one data rank, drop it."
        )
