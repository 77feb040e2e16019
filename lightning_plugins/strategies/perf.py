"""``PerfCallback``: the Lightning door's side of :mod:`lightning_plugins.run.perf` (profile window, stragglers)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override

from lightning_plugins.run.perf import PerfMonitor, ProfileOptions
from lightning_plugins.strategies.step_end import StepEndCallback


class PerfCallback(StepEndCallback):
    """Profiles ``train.profile``'s optimizer steps and samples the last step of every ``log_every`` window
    (:class:`~lightning_plugins.run.perf.PerfMonitor`); the ``perf/*`` metrics are logged with the step's others.
    ``ParallelismStrategy`` adds it to every ``fit`` given a ``perf`` setting (:func:`add_perf`).

    Args:
        output_dir: Where ``profile/`` and ``ranks.jsonl`` go.
        log_every: Optimizer steps per log window.
        profile: The profile window, or ``None``.
        sample: Whether to sample the last step of every log window.
        straggler_ratio: Rank 0 prints the slowest rank past this ratio to the median own time.
    """

    def __init__(
        self,
        output_dir: str | Path,
        log_every: int,
        profile: ProfileOptions | None,
        *,
        sample: bool = True,
        straggler_ratio: float = 1.25,
    ) -> None:
        super().__init__()
        self.output_dir, self.log_every, self.profile = output_dir, log_every, profile
        self.sample, self.straggler_ratio = sample, straggler_ratio
        self._monitor: PerfMonitor | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        cuda = trainer.strategy.root_device.type == "cuda"
        self._monitor = PerfMonitor(
            self.output_dir, self.log_every, self.profile, straggler_ratio=self.straggler_ratio, sample=self.sample,
            cuda=cuda,
        )  # fmt: skip
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        self._monitor.begin(self._step, int(total))

    @override
    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        if self._monitor is None:
            return
        metrics = self._monitor.step_end(step)
        if metrics:
            pl_module.log_dict(metrics, rank_zero_only=True)
        self._monitor.next_step(step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.release()

    @override
    def release(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None


def add_perf(trainer: pl.Trainer, callback: PerfCallback | None) -> None:
    """Give ``trainer`` the strategy's :class:`PerfCallback` unless it has one already."""
    if callback is not None and not any(isinstance(c, PerfCallback) for c in trainer.callbacks):
        trainer.callbacks.append(callback)
