"""What both doors record about a run, whatever loggers it uses: the hyperparameters and the logger names.

The engine's half of ``train.loggers``: the names a recipe may give, the resolved recipe flattened into the
hyperparameters every logger stores, and where each logger writes (project, directories, offline mode), so the
Lightning loggers and the Accelerate trackers built from them (:mod:`lightning_plugins.strategies.loggers`,
:mod:`lightning_plugins.accelerate.metrics`) agree. Nothing here imports Lightning or Accelerate.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_plugins.recipe.schema import Recipe
    from lightning_plugins.recipe.train import TrainSection

LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")
"""The names ``train.loggers`` takes (CSV is written in any case: ``metrics.csv`` and the loss curve come from it)."""
LOGGER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                   "mlflow": ("mlflow", "mlflow-skinny")}  # fmt: skip
"""Each logger's module, and the distribution that installs it (the ``loggers`` extra)."""


def hyperparameters(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as flat dotted keys (``optim.lr``, ``layout.tp_size``): what every logger stores.

    Scalars stay as they are; lists and ``None`` become their JSON text, which every logger takes as a value.
    """
    flat: dict[str, Any] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (bool, int, float, str)):
            flat[prefix] = value
        else:
            flat[prefix] = json.dumps(value)

    visit("", json.loads(recipe.model_dump_json()))
    return flat


def project_name(train: TrainSection) -> str:
    """``train.project``, or the output directory's name: the wandb project and the MLflow experiment."""
    return train.project or Path(train.output_dir).resolve().name


def mlflow_tracking_uri(train: TrainSection) -> str:
    """``MLFLOW_TRACKING_URI`` when set (MLflow's own habit), else a file store in ``output_dir/mlruns``.

    MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` is set (its database stores need SQLAlchemy,
    which ``mlflow-skinny`` lacks), so that opt-out is set for this process when the store is ours.
    """
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (Path(train.output_dir).resolve() / "mlruns").as_uri()


def wandb_offline(train: TrainSection) -> bool:
    """``train.wandb_offline``, or ``WANDB_MODE=offline`` (wandb's own habit)."""
    return train.wandb_offline or os.environ.get("WANDB_MODE") == "offline"
