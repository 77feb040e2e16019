"""The Lightning door's ``train.loggers``: Lightning's own loggers, and the run's record at the start of fit.

Each writes where the Accelerate door's tracker of the same name writes (:mod:`lightning_plugins.recipe.record`):
CSV in ``output_dir/logs/version_<N>`` (always), TensorBoard in ``output_dir/tensorboard/version_<N>``, wandb in
``output_dir/wandb``, MLflow in ``output_dir/mlruns`` (or ``MLFLOW_TRACKING_URI``); each attempt is a run named
``version_<N>``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from typing_extensions import override

from lightning_plugins.recipe.manifest import write_manifest
from lightning_plugins.recipe.schema import Recipe
from lightning_plugins.recipe.record import hyperparameters, mlflow_tracking_uri, project_name, wandb_offline


def recipe_loggers(recipe: Recipe) -> list[Logger]:
    """The loggers ``train.loggers`` names, CSV first (always): the ``Trainer``'s ``logger=``."""
    train = recipe.train
    out = Path(train.output_dir)
    csv = CSVLogger(out, name="logs")  # one version per attempt; merged at the end
    run = f"version_{csv.version}"
    loggers: list[Logger] = [csv]
    if "tensorboard" in train.loggers:
        loggers.append(TensorBoardLogger(out, name="tensorboard", version=run, default_hp_metric=False))
    if "wandb" in train.loggers:
        wandb = WandbLogger(name=run, save_dir=out, project=project_name(train), offline=wandb_offline(train))
        # Lightning 2.6 hands wandb.init `anonymous=None` and `resume="allow"`, which wandb warns about on the console
        # (0.31: anonymous has no effect; before it, offline: resume is ignored). With a new run per attempt (no id),
        # neither does anything.
        for key in ("anonymous", "resume"):
            wandb._wandb_init.pop(key, None)
        loggers.append(wandb)
    if "mlflow" in train.loggers:
        loggers.append(
            MLFlowLogger(experiment_name=project_name(train), run_name=run, tracking_uri=mlflow_tracking_uri(train))
        )
    return loggers


class RecordRun(Callback):
    """At the start of fit (the process group is up): ``output_dir/run.json`` and the hyperparameters of every logger.

    Args:
        recipe: The run's recipe.
    """

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        write_manifest(self.recipe)
        for logger in trainer.loggers:  # Lightning's loggers write on global rank 0 only
            logger.log_hyperparams(hyperparameters(self.recipe))
