"""``PipelineParallelStrategy``: decoder layers split into pipeline stages, micro-batches streamed."""

from __future__ import annotations

from typing import Any

from lightning_plugins.errors import LayoutError
from lightning_plugins.strategies.parallelism import ParallelismStrategy

__all__ = ["PipelineParallelStrategy"]


class PipelineParallelStrategy(ParallelismStrategy):
    """Pipeline parallelism for HF causal LMs, composable with tensor parallelism and FSDP2.

    The LightningModule stays unchanged: its ``training_step`` calls ``self.model(**batch).loss`` as
    usual. Under this strategy that call runs forward *and* backward of every micro-batch of the batch
    through the schedule and returns the batch's global mean token loss (identical on every rank, so it
    can be logged); Lightning's own backward is skipped. Validation calls run forward only. Each rank's
    optimizer holds only its stages' parameters; gradient clipping uses the norm over all stages.

    Requirements: batches carry ``input_ids`` and ``labels`` (``attention_mask``/``position_ids``
    optional); the per-rank batch size divides into ``microbatches``; the model returns no logits.
    Fixed-length padding avoids rebuilding the stages for every new sequence length.

    Args:
        pp_size: Pipeline ranks.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"`` or ``"dualpipev"``.
        microbatches: Micro-batches per step; ``None`` takes the number of stages.
        stages_per_rank: ``None`` takes 1, or 2 for interleaved and V-shaped schedules.
        **kwargs: Any option of :class:`ParallelismStrategy` (``tp_size``, ``dp_shard_size``, ...).
    """

    strategy_name = "pipeline_parallel"

    def __init__(
        self,
        pp_size: int = 2,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        if any(key.startswith("pp_") for key in kwargs):
            raise LayoutError(
                f"{type(self).__name__} takes the pipeline options as `schedule`, `microbatches` and"
                f" `stages_per_rank`, not {sorted(k for k in kwargs if k.startswith('pp_'))}."
            )
        if not isinstance(pp_size, int) or pp_size < 2:
            raise LayoutError(
                f"{type(self).__name__}: pp_size must be an integer >= 2, got {pp_size!r}. For pp_size=1 use"
                " ParallelismStrategy (or TensorParallelStrategy)."
            )
        super().__init__(
            pp_size=pp_size, pp_schedule=schedule, pp_microbatches=microbatches, pp_stages_per_rank=stages_per_rank,
            **kwargs,
        )
        # Fail on a bad schedule or micro-batch count now, before Trainer(...) launches any process.
        self.pipeline_options = self.options.pipeline.resolve(pp_size)
