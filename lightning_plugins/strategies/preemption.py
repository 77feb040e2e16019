"""``PreemptionCallback``: the Lightning door's side of :mod:`lightning_plugins.run.preemption`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_plugins.run.preemption import Preemption
from lightning_plugins.checkpoint.checks import CHECKPOINT_NAME
from lightning_plugins.strategies.step_end import StepEndCallback


class PreemptionCallback(StepEndCallback):
    """On a preemption signal (or, in a rank a launcher started, the launcher's death), every rank finishes its
    optimizer step, the ``ModelCheckpoint`` writes ``step=N.ckpt`` (the one auto-resume picks), and the run exits with
    :data:`~lightning_plugins.run.preemption.PREEMPTED_EXIT` at the next hook (after Lightning has logged the step).
    ``ParallelismStrategy`` adds it to every ``fit`` (:func:`add_preemption`), users' own LightningModules included.

    The handlers replace Lightning's own ``SIGTERM`` (and SLURM ``SIGUSR1``) handlers for the training (installed at
    ``on_train_start``, after Lightning's): Lightning's runs a collective inside the handler and re-sends the signal
    to the other local ranks (whose handlers run that collective again), so the ranks' collectives stop pairing up
    and the job waits for the collective timeout; its SLURM handler writes an ``hpc_ckpt`` that auto-resume ignores.

    Args:
        signals: Names of the preemption signals (the recipe's ``train.preempt_signals``).
        launched: Whether this process was started by a launcher it must not outlive (not the launching rank).
    """

    def __init__(self, signals: Sequence[str], launched: bool) -> None:
        super().__init__()
        self.signals, self.launched = list(signals), launched
        self._preemption: Preemption | None = None
        self._stopping = False
        self._saved: Path | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._preemption = Preemption(self.signals, watch_parent=self.launched)
        self._preemption.install()

    @override
    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        if self._preemption is None:
            return
        if not self._preemption.agree(trainer.strategy.root_device):
            return
        checkpoint = trainer.checkpoint_callback
        self._saved = None
        if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath is not None:
            self._saved = Path(checkpoint.dirpath) / f"{CHECKPOINT_NAME.format(step=step)}.ckpt"
            if checkpoint._last_global_step_saved != step:  # not written by it in this very step
                checkpoint._save_checkpoint(trainer, str(self._saved))
        self._stopping = True  # at the next hook: Lightning logs this step's metrics after this one

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._stop_if_preempted(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_if_preempted(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_if_preempted(trainer)
        self.release()

    def _stop_if_preempted(self, trainer: pl.Trainer) -> None:
        if not self._stopping or self._preemption is None:
            return
        for logger in trainer.loggers:  # the steps before the checkpoint are not run again
            logger.save()
        self._preemption.finish(trainer.global_step, self._saved)

    @override
    def release(self) -> None:
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None


def add_preemption(trainer: pl.Trainer, signals: Sequence[str], launched: bool) -> None:
    """Give ``trainer`` a :class:`PreemptionCallback` unless it has one (appended: it then runs after the
    ``ModelCheckpoint``, which may already have written this step's checkpoint). With no ``signals`` it still ends a
    ``launched`` rank whose launcher is gone."""
    if not any(isinstance(callback, PreemptionCallback) for callback in trainer.callbacks):
        trainer.callbacks.append(PreemptionCallback(signals, launched))
