"""``ExpertBalanceCallback``: the Lightning door's side of :mod:`lightning_plugins.parallel.moe.experts_balance`."""

from __future__ import annotations

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_plugins.parallel.moe.experts_balance import ExpertBalance
from lightning_plugins.strategies.step_end import StepEndCallback


class ExpertBalanceCallback(StepEndCallback):
    """Logs the ``moe/*`` routing figures (``moe/load_max_over_mean``, ``moe/router_entropy``) of every
    ``trainer.log_every_n_steps`` optimizer steps, over every rank, with the step's other metrics.

    ``ParallelismStrategy`` adds one to every ``fit`` of a mixture-of-experts model (:func:`add_balance`).

    Args:
        balance: The counters installed on the model.
    """

    def __init__(self, balance: ExpertBalance) -> None:
        super().__init__()
        self.balance = balance

    @override
    def on_step_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        if step % max(1, trainer.log_every_n_steps):
            return
        figures = self.balance.read()  # every rank: one all-reduce
        if figures:
            pl_module.log_dict(figures, rank_zero_only=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.release()

    @override
    def release(self) -> None:
        self.balance.remove()


def add_balance(trainer: pl.Trainer, model: nn.Module | None) -> None:
    """Give ``trainer`` an :class:`ExpertBalanceCallback` on a mixture-of-experts ``model`` (replacing any earlier)."""
    for old in [c for c in trainer.callbacks if isinstance(c, ExpertBalanceCallback)]:
        old.release()
        trainer.callbacks.remove(old)
    balance = None if model is None else ExpertBalance.of(model)
    if balance is not None:
        trainer.callbacks.append(ExpertBalanceCallback(balance))
