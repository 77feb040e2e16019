"""``StepEndCallback``: a Lightning callback that acts once after each optimizer step, not after every micro-batch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class StepEndCallback(Callback):
    """Calls :meth:`on_step_end` once per optimizer step, after it: ``on_train_batch_end`` runs after every
    micro-batch, and inside a gradient-accumulation window ``trainer.global_step`` has not moved yet.

    Subclasses that override ``on_train_start`` call this one's first; what they set up there they undo in
    :meth:`release`, which runs on an exception (and wherever else they call it, e.g. ``on_train_end``).
    """

    def __init__(self) -> None:
        self._step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._step:  # inside an accumulation window
            return
        self._step = step
        self.on_step_end(trainer, pl_module, step)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.release()

    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        """After optimizer step ``step`` (``trainer.global_step``, the steps taken so far)."""

    def release(self) -> None:
        """Undo what ``on_train_start`` set up; a second call does nothing."""
