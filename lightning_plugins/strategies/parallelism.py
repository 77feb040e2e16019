"""``ParallelismStrategy``: the Lightning door to the engine (TP/SP/loss parallel + FSDP2/HSDP)."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_plugins.layout import LayoutError, ParallelLayout
from lightning_plugins.loading import is_on_meta, load_sharded_safetensors
from lightning_plugins.models import check_supported
from lightning_plugins.parallel import clip_grad_norm_, parallelize

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ParallelismStrategy(ModelParallelStrategy):
    """Tensor (with sequence and loss parallel) and fully-sharded data parallelism for HF models.

    The strategy finds the ``transformers.PreTrainedModel`` inside the LightningModule and applies the
    layout to it; no ``configure_model`` is needed. A module that overrides ``configure_model`` is left
    to parallelize itself (``parallelize(self.model, self.device_mesh)``).

    Args:
        tp_size: Tensor-parallel ranks.
        pp_size: Pipeline stages (later releases; must be 1 here).
        cp_size: Context-parallel ranks (later releases; must be 1 here).
        dp_shard_size: FSDP2 shard ranks; ``-1`` takes whatever the world size leaves.
        dp_replicate_size: Data-parallel replicas (HSDP when combined with ``dp_shard_size > 1``).
        sequence_parallel: Shard norms and the residual stream along the sequence (with TP).
        loss_parallel: Cross entropy on vocab-sharded logits, never gathering them (with TP).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"``.
        every_n_layers: With ``"selective"``: checkpoint every N-th layer instead of op-level.
        param_dtype: FSDP2 compute dtype, e.g. ``"bf16"`` (GPU); ``None`` keeps the parameters' dtype.
        reduce_dtype: FSDP2 gradient-reduction dtype, e.g. ``"fp32"``.
        cpu_offload: FSDP2 ``CPUOffloadPolicy`` (pinned memory on GPUs; unpinned on CPU).
        reshard_after_forward: FSDP2 ZeRO-3 (``True``) or keep parameters gathered until backward.
        load_from: HF checkpoint directory to read this rank's weight slices from when the model was
            built on the meta device; defaults to the model config's ``name_or_path``.
        save_distributed_checkpoint: DCP sharded checkpoints (``True``) or one full file on rank 0.
        process_group_backend: ``"nccl"`` / ``"gloo"``; chosen from the device when ``None``.
        timeout: Collective timeout.
    """

    strategy_name = "parallelism"

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        cp_size: int = 1,
        dp_shard_size: int = -1,
        dp_replicate_size: int = 1,
        *,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        activation_checkpointing: str = "none",
        every_n_layers: int | None = None,
        param_dtype: str | torch.dtype | None = None,
        reduce_dtype: str | torch.dtype | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        load_from: str | Path | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.layout = ParallelLayout(pp_size, dp_replicate_size, dp_shard_size, cp_size, tp_size)
        self.parallelize_options: dict[str, Any] = {
            "sequence_parallel": sequence_parallel,
            "loss_parallel": loss_parallel,
            "activation_checkpointing": activation_checkpointing,
            "every_n_layers": every_n_layers,
            "param_dtype": param_dtype,
            "reduce_dtype": reduce_dtype,
            "cpu_offload": cpu_offload,
            "reshard_after_forward": reshard_after_forward,
        }
        self.load_from = load_from

    @override
    def setup_environment(self) -> None:
        assert self.lightning_module is not None
        # Validate against the world size and the model before any process group exists.
        self.layout = self.layout.resolve(self.num_nodes * self.num_processes)
        if not is_overridden("configure_model", self.lightning_module):
            model = find_hf_model(self.lightning_module, type(self).__name__)
            check_supported(model)
            self.layout.validate(model.config)
        self._setup_distributed()
        self._device_mesh = self.layout.build_mesh(self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor- and context-parallel peers must see the same samples: shard over `dp` only.
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        assert self.lightning_module is not None
        self.accelerator.setup(trainer)
        if not is_overridden("configure_model", self.lightning_module):
            model = find_hf_model(self.lightning_module, type(self).__name__)
            parallelize(model, self.device_mesh, **self.parallelize_options)
            if is_on_meta(model):
                load_sharded_safetensors(model, self._checkpoint_dir(model), self.root_device)
        check_supported(self.model)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning's clipping calls torch's clip_grad_norm_, which fails on DTensors of several meshes
        # and would miss pipeline stages: route it to the engine's true global norm.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        parameters = self.precision_plugin.main_params(optimizer)
        clip_grad_norm_(parameters, clip_val, pp_mesh=self.device_mesh["pp"])

    def _checkpoint_dir(self, model: nn.Module) -> Path:
        source = self.load_from or getattr(model.config, "name_or_path", None)
        if not source or not Path(source).is_dir():
            raise LayoutError(
                f"{type(self).__name__}: the model is on the meta device but no local HF checkpoint directory is"
                f" known (config.name_or_path={source!r}). Pass `load_from=<dir with *.safetensors>`."
            )
        return Path(source)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write the checkpoint next to its destination, then move it into place: never half-written."""
        path = Path(self.broadcast(filepath))
        partial = path.with_name(path.name + ".partial")
        if self.global_rank == 0 and partial.exists():
            shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.global_rank == 0:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            partial.rename(path)
        self.barrier()


def find_hf_model(module: nn.Module, owner: str) -> nn.Module:
    """The one outermost ``transformers.PreTrainedModel`` inside ``module``.

    Raises:
        LayoutError: if there is none, or several unrelated ones.
    """
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, sub))
    if len(found) != 1:
        what = "no transformers PreTrainedModel" if not found else f"{len(found)} models ({[n for n, _ in found]})"
        raise LayoutError(
            f"{owner} found {what} inside {type(module).__name__}. Keep exactly one HF causal LM as an attribute"
            " (e.g. `self.model = AutoModelForCausalLM.from_config(...)`), or override `configure_model` and call"
            " `lightning_plugins.parallelize(model, self.device_mesh)` yourself."
        )
    return found[0][1]
