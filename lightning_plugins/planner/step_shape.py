"""The sizes of one training step that the step-time model needs: layout, pipeline, batch, checked (:class:`StepShape`)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.errors import LayoutError, OptionsError
from lightning_plugins.parallel.options import ParallelOptions
from lightning_plugins.planner.hardware import Cluster
from lightning_plugins.planner.model_stats import ModelStats
from lightning_plugins.errors import PlannerError


@dataclass(frozen=True)
class StepShape:
    """Sizes of one step: the layout, the pipeline and the batch, checked (:meth:`of`)."""

    layout: ParallelLayout
    seq_len: int
    micro_batch_size: int
    accumulation: int
    microbatches: int  # pipeline micro-batches per forward (1 without PP)
    stages_per_rank: int
    schedule: str
    split_backward: bool
    sequence_parallel: bool
    cp_backend: str
    stage_layers: tuple[tuple[int, bool, bool], ...]  # per pp rank: (layers, holds the embedding, holds lm_head)
    no_grad_forwards: int = 0  # of each micro-batch beside the policy's (DPO's reference 1, KTO 3), no backward

    @classmethod
    def of(
        cls,
        stats: ModelStats,
        layout: ParallelLayout,
        options: ParallelOptions,
        cluster: Cluster,
        seq_len: int,
        micro_batch_size: int,
        global_batch_size: int,
        no_grad_forwards: int = 0,
    ) -> StepShape:
        if not isinstance(layout, ParallelLayout):
            raise PlannerError(f"layout must be a ParallelLayout, got {type(layout).__name__}.")
        if layout.dp_shard_size == -1:
            raise PlannerError(
                f"estimate_step_time needs a resolved layout (dp_shard_size=-1 is open): pass"
                f" `layout.resolve({cluster.gpus})`."
            )
        if layout.world_size != cluster.gpus:
            raise PlannerError(
                f"The layout spans {layout.world_size} ranks ({layout_str(layout)}) but the cluster has {cluster.gpus}"
                f" GPUs. Resolve the layout for the cluster: `layout.resolve({cluster.gpus})` with dp_shard_size=-1."
            )
        for name, value in (
            ("seq_len", seq_len),
            ("micro_batch_size", micro_batch_size),
            ("global_batch_size", global_batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerError(f"{name}={value!r} must be a positive integer.")
        check_divisible(stats, layout, seq_len)
        dp = layout.dp_size
        accumulation = global_batch_size // (micro_batch_size * dp)
        if accumulation < 1:
            raise PlannerError(
                f"global_batch_size={global_batch_size} rows cannot feed {dp} data ranks with micro_batch_size="
                f"{micro_batch_size} each. Use global_batch_size >= {micro_batch_size * dp} (a multiple of"
                f" micro_batch_size x data ranks) or a smaller micro_batch_size."
            )
        m, v, schedule, split_backward = 1, 1, "", False
        stage_layers: tuple[tuple[int, bool, bool], ...] = ((stats.num_layers, True, True),)
        if layout.pp_size > 1:
            from lightning_plugins.parallel.pipeline import PipelineOptions, layer_ranges, stages_of_rank

            try:
                pipe = PipelineOptions.of(options).resolve(layout.pp_size, stats.num_layers)
            except (LayoutError, OptionsError) as err:
                raise PlannerError(str(err)) from None
            m, v, schedule, split_backward = (
                pipe.microbatches,
                pipe.stages_per_rank,
                pipe.schedule,
                pipe.spec.split_backward,
            )
            if micro_batch_size % m:
                raise PlannerError(
                    f"micro_batch_size={micro_batch_size} rows per data rank do not split into pp_microbatches={m}"
                    f" equal micro-batches. Use a micro_batch_size that is a multiple of {m}, or fewer pp_microbatches."
                )
            ranges = layer_ranges(stats.num_layers, layout.pp_size * v)
            last = layout.pp_size * v - 1
            stage_layers = tuple(
                (sum(len(ranges[s]) for s in stages), 0 in stages, last in stages)
                for stages in (stages_of_rank(r, layout.pp_size, pipe) for r in range(layout.pp_size))
            )
        return cls(
            layout=layout,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            accumulation=accumulation,
            microbatches=m,
            stages_per_rank=v,
            schedule=schedule,
            split_backward=split_backward,
            sequence_parallel=options.sequence_parallel,
            cp_backend=options.cp_backend,
            stage_layers=stage_layers,
            no_grad_forwards=no_grad_forwards,
        )

    @property
    def tokens_per_microbatch(self) -> float:
        """Tokens one rank handles per pipeline micro-batch (its CP share of the sequence)."""
        return self.micro_batch_size / self.microbatches * self.seq_len / self.layout.cp_size

    def bubble_fraction(self) -> float:
        """Share of the pipeline's time idle (0 without pipelining)."""
        p, m, v = self.layout.pp_size, self.microbatches, self.stages_per_rank
        if p == 1 or self.schedule in ("zbv_zero_bubble", "dualpipev"):
            return 0.0
        idle = (p - 1) / v
        if self.schedule == "interleaved_zero_bubble":
            idle /= 3
        return idle / (m + idle)


def check_divisible(stats: ModelStats, layout: ParallelLayout, seq_len: int) -> None:
    t, c = layout.tp_size, layout.cp_size
    for name, value in (("num_attention_heads", stats.num_heads), ("num_key_value_heads", stats.num_kv_heads)):
        if value % t:
            raise PlannerError(
                f"tp_size={t} does not divide {name}={value}: each tensor-parallel rank needs whole heads. Use a"
                f" tp_size that divides {name}."
            )
    if seq_len % c:
        raise PlannerError(
            f"seq_len={seq_len} does not split into cp_size={c} equal chunks. Use a seq_len that is a multiple of {c}."
        )
    if layout.pp_size > stats.num_layers:
        raise PlannerError(f"pp_size={layout.pp_size} exceeds the model's {stats.num_layers} layers.")


def layout_str(layout: ParallelLayout) -> str:
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    return " x ".join(f"{n}{s}" for n, s in zip(names, layout.sizes) if s > 1) or "1 rank"
