"""``PipelineParallelStrategy``: decoder layers split into pipeline stages, micro-batches streamed."""

from __future__ import annotations

from typing import Any

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.layout import ParallelLayout
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
    optional); the per-rank batch size divides into ``pp_microbatches``; the model returns no logits.
    Fixed-length padding avoids rebuilding the stages for every new sequence length.

    Args:
        pp_size: Pipeline ranks (at least 2); ``None`` takes ``layout``'s, or 2.
        layout: The parallel sizes as one :class:`~lightning_plugins.ParallelLayout` (``pp_size`` overrides its own).
        pp_schedule, pp_microbatches, pp_stages_per_rank: The pipeline's :class:`~lightning_plugins.ParallelOptions`
            fields (``None`` keeps ``options``' own or the default): ``pp_schedule`` (``"gpipe"``, ``"1f1b"``,
            ``"interleaved_1f1b"``, ``"looped_bfs"``, ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"`` or
            ``"dualpipev"``), ``pp_microbatches`` (``None`` takes the number of stages) and ``pp_stages_per_rank``
            (``None`` takes 1, or 2 for interleaved and V-shaped schedules).
        **kwargs: Any option of :class:`ParallelismStrategy` (``tp_size``, ``dp_shard_size``, ...).
    """

    strategy_name = "pipeline_parallel"

    def __init__(
        self,
        *,
        pp_size: int | None = None,
        layout: ParallelLayout | None = None,
        pp_schedule: str | None = None,
        pp_microbatches: int | None = None,
        pp_stages_per_rank: int | None = None,
        **kwargs: Any,
    ) -> None:
        # Named here (not only through **kwargs) so that LightningCLI and jsonargparse see them; None: the default.
        pipeline = {"pp_schedule": pp_schedule, "pp_microbatches": pp_microbatches, "pp_stages_per_rank": pp_stages_per_rank}
        kwargs.update({key: value for key, value in pipeline.items() if value is not None})
        if pp_size is None:
            pp_size = 2 if layout is None else layout.pp_size
        if not isinstance(pp_size, int) or pp_size < 2:
            raise LayoutError(
                f"{type(self).__name__}: pp_size must be an integer >= 2, got {pp_size!r}. For pp_size=1 use"
                " ParallelismStrategy (or TensorParallelStrategy)."
            )
        # The schedule and micro-batch count are checked here (ParallelismStrategy), before Trainer(...) launches.
        super().__init__(pp_size=pp_size, layout=layout, **kwargs)
