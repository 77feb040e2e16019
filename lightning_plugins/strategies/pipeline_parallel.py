"""``PipelineParallelStrategy``: decoder layers split into pipeline stages, micro-batches streamed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_plugins.layout import LayoutError
from lightning_plugins.parallel.pipeline import PipelineOptions, check_pipeline_layout
from lightning_plugins.strategies.parallelism import ParallelismStrategy, find_hf_model

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
        if kwargs.get("save_distributed_checkpoint") is False:
            raise LayoutError(
                f"{type(self).__name__} writes sharded (DCP) checkpoints only: each rank holds different stages, so"
                " no rank can write the full model. Keep save_distributed_checkpoint=True and export to HF format"
                " from the sharded checkpoint."
            )
        super().__init__(pp_size=pp_size, **kwargs)
        # Fail on a bad schedule or micro-batch count now, before Trainer(...) launches any process.
        self.pipeline_options = PipelineOptions(schedule, microbatches, stages_per_rank).resolve(pp_size)
        self.parallelize_options.update(
            pp_schedule=schedule, pp_microbatches=microbatches, pp_stages_per_rank=stages_per_rank
        )

    @override
    def setup_environment(self) -> None:
        assert self.lightning_module is not None
        # The model's layer count is known now: check the stages before any process group exists.
        layout = self.layout.resolve(self.num_nodes * self.num_processes)
        model = find_hf_model(self.lightning_module, type(self).__name__)
        options = PipelineOptions(
            self.parallelize_options["pp_schedule"],
            self.parallelize_options["pp_microbatches"],
            self.parallelize_options["pp_stages_per_rank"],
        )
        self.pipeline_options = check_pipeline_layout(layout, model.config, options)
        super().setup_environment()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's optimizer state, flattened to one entry per parameter name.

        Pipeline ranks hold different parameters, so their ``param_groups`` differ; DCP keeps one copy of
        a non-tensor entry per key, which would hand every rank the first rank's groups. Flattened,
        every hyper-parameter is stored under its parameter's name and each rank reads back its own.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.model, optimizer, options=_FLAT)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded (DCP) checkpoint written by :meth:`save_checkpoint`: each rank reads its stages.

        Lightning's loader only recognises models with DTensor parameters (with pipeline parallelism
        alone each rank holds plain tensors of its own stages) and reads optimizer groups unflattened.
        """
        from lightning.fabric.strategies.model_parallel import (
            _METADATA_FILENAME,
            _distributed_checkpoint_load,
            _is_sharded_checkpoint,
        )
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None
        assert self.lightning_module is not None
        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            raise LayoutError(
                f"{type(self).__name__} loads sharded (DCP) checkpoint directories, and {str(path)!r} is not one."
                " Save with save_distributed_checkpoint=True (the default)."
            )
        module_state = {"state_dict": get_model_state_dict(self.model)}
        _distributed_checkpoint_load(module_state, path)
        self.model.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer, options=_FLAT)}
            _distributed_checkpoint_load(optimizer_state, path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optimizer_state[key], options=_FLAT)
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def _flat_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


_FLAT = _flat_options()
