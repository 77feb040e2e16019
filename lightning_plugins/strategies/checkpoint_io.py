"""The Lightning door's checkpoint I/O: Lightning's hooks adapted to the atomic DCP protocol of
:mod:`lightning_plugins.checkpoint.dcp` (the Accelerate door drives the same protocol)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer
from typing_extensions import override

from lightning_plugins.checkpoint import dcp
from lightning_plugins.checkpoint.checks import reads_checkpoint
from lightning_plugins.checkpoint.export_info import save_export_info
from lightning_plugins.checkpoint.integrity import save_checksummed, verify_on_first_rank
from lightning_plugins.checkpoint.resume import publish, read_rng, restore_rng
from lightning_plugins.checkpoint.safe_read import load_torch_file, refusing
from lightning_plugins.errors import LayoutError
from lightning_plugins.recipe.diff import record_recipe
from lightning_plugins.run.nonfinite import check_finite_weights, training_state

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ModelParallelStrategy

    _Base = ModelParallelStrategy
else:
    _Base = object


class ShardedCheckpoints(_Base):
    """Mixin for :class:`~lightning_plugins.strategies.ParallelismStrategy` (before ``ModelParallelStrategy`` in its
    bases): sharded checkpoints written atomically (also in the background, with ``async_checkpoint``) and read back
    under any layout, with every rank's random states, the export info and the recipe.

    It uses the strategy's ``layout``, ``load_from``, ``recipe_record``, ``async_checkpoint``, ``_saver`` (an
    :class:`~lightning_plugins.checkpoint.async_save.AsyncCheckpointer`) and sets ``last_checkpoint``.
    """

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """For sharded checkpoints: this rank's optimizer state in the one format of every checkpoint
        (:data:`~lightning_plugins.checkpoint.dcp.FLAT_OPTIMIZER`), so a checkpoint resumes under any other layout
        (pipeline or not)."""
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return dcp.optimizer_state(self.model, optimizer)

    @reads_checkpoint  # a corrupted checkpoint, or one of another model, gets an error naming it and the fix
    def _load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded (DCP) checkpoint, each rank reading its slices (or its stages) whatever layout wrote it.

        Lightning's loader only recognises models with DTensor parameters (with pipeline parallelism
        alone each rank holds plain tensors of its own stages) and reads optimizer groups unflattened. Every file is
        read weights-only whatever ``weights_only`` says (:mod:`~lightning_plugins.checkpoint.safe_read`): a
        checkpoint never runs code.
        """
        from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME, _is_sharded_checkpoint
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        if self.layout.pp_size == 1 and not _is_sharded_checkpoint(Path(self.broadcast(checkpoint_path))):
            with refusing(checkpoint_path):  # Lightning's own loader (a single file): weights-only, refusals named
                return super().load_checkpoint(checkpoint_path, weights_only=True)
        assert self.model is not None
        assert self.lightning_module is not None
        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            raise LayoutError(
                f"{type(self).__name__} loads sharded (DCP) checkpoint directories, and {str(path)!r} is not one."
                " Save with save_distributed_checkpoint=True (the default)."
            )
        module_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load_tensors(module_state, path)
        strict = StateDictOptions(strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, module_state["state_dict"], options=strict)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: dcp.optimizer_state(self.model, optimizer)}
            dcp.load_tensors(optimizer_state, path)
            dcp.load_optimizer_state(self.model, optimizer, optimizer_state[key])
        return load_torch_file(path / _METADATA_FILENAME)  # the loop and data positions: plain data

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write the checkpoint (and every rank's random states) next to its destination, then move it into place.

        A save killed at any point leaves only ``<name>.partial`` (never loaded; removed by the next save) and
        the previous checkpoints untouched. With ``async_checkpoint`` the sharded tensors are written in the
        background (see :class:`~lightning_plugins.checkpoint.async_save.AsyncCheckpointer`) and the checkpoint is moved
        into place when they are complete.
        """
        path = Path(self.broadcast(filepath))
        assert self.lightning_module is not None
        state = training_state(self.lightning_module.parameters(), self.optimizers)
        check_finite_weights(state, f"checkpoint {path}", self.lightning_module.trainer.global_step)
        self.last_checkpoint = path
        if self._save_distributed_checkpoint:
            self._save_sharded(checkpoint, path, storage_options)
            return
        partial = dcp.begin_save(path, self.global_rank, self.barrier, self._saver)
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.global_rank == 0:
            publish(partial, path)
        self.barrier()

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path, storage_options: Any) -> None:
        """Lightning's sharded save (DCP tensors, ``meta.pt`` with the loop and data positions), plus the random states
        and the export info, through :func:`lightning_plugins.checkpoint.dcp.save_sharded`."""
        from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported.")
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})

        def write_files(partial: Path) -> None:
            save_checksummed(checkpoint, partial / _METADATA_FILENAME)
            save_export_info(partial, self.lightning_module, "state_dict", self.load_from)
            if self.recipe_record is not None:
                record_recipe(partial, self.recipe_record)

        saver = self._saver if self.async_checkpoint else None
        dcp.save_sharded(
            tensors, path, rank=self.global_rank, barrier=self.barrier, write_files=write_files, saver=saver
        )

    @override
    def on_train_end(self) -> None:
        self._saver.wait()  # the last checkpoint is complete and published before fit returns
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._saver.close(failed=True)  # finish (or abandon, unpublished) a save in flight before the job ends
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._saver.close()
        super().teardown()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimizer (see :meth:`_load_checkpoint`); keep this rank's random states for the training
        start (restoring them now would let setup draw from them: the run would no longer draw what it would have)."""
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():  # its files against its checksums, before anything is read
            verify_on_first_rank(path, self.global_rank, self.broadcast)
        checkpoint = self._load_checkpoint(checkpoint_path, weights_only)
        self.last_checkpoint = path
        self._rng_to_restore = read_rng(path, self.global_rank) if path.is_dir() else None
        return checkpoint

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        states, self._rng_to_restore = getattr(self, "_rng_to_restore", None), None
        if states is not None:
            restore_rng(states)
