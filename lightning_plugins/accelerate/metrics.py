"""The Accelerate door's trackers: ``train.loggers`` as Accelerate's own, plus the CSV the Lightning door writes.

CSV: ``output_dir/logs/version_<N>/metrics.csv`` (one version per attempt) as Lightning's ``CSVLogger`` writes it,
columns sorted by name, one row per log call with ``epoch`` and ``step``: what
:func:`lightning_plugins.recipe.plots.merge_metrics` reads, so both doors' runs plot alike. TensorBoard, wandb and MLflow
are Accelerate's ``TensorBoardTracker``, ``WandBTracker`` and ``MLflowTracker``, writing where the Lightning door's
loggers write (:mod:`lightning_plugins.recipe.record`); each attempt is a run named ``version_<N>``.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import yaml
from accelerate.tracking import GeneralTracker, MLflowTracker, TensorBoardTracker, WandBTracker, on_main_process
from typing_extensions import override

from lightning_plugins.recipe.schema import Recipe
from lightning_plugins.recipe.record import mlflow_tracking_uri, project_name, wandb_offline


def next_version(log_root: str | Path) -> int:
    """The first free ``version_<N>`` under ``log_root``: this attempt's."""
    names = [p.name.split("_")[1] for p in Path(log_root).glob("version_*")]
    return max((int(n) for n in names if n.isdigit()), default=-1) + 1


class CSVTracker(GeneralTracker):
    """Rows of metrics for one attempt, rewritten to ``log_root/version_<N>/metrics.csv`` on every log call.

    Args:
        log_root: The ``logs`` directory.
        version: This attempt's ``N`` (:func:`next_version`).
    """

    name = "csv"
    requires_logging_directory = False

    def __init__(self, log_root: str | Path, version: int) -> None:
        super().__init__()
        self.path = Path(log_root) / f"version_{version}" / "metrics.csv"
        self.rows: list[dict[str, Any]] = []

    @property
    def tracker(self) -> CSVTracker:
        return self

    @override
    @on_main_process
    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @override
    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """``hparams.yaml`` next to the metrics, as Lightning's ``CSVLogger`` writes it."""
        (self.path.parent / "hparams.yaml").write_text(yaml.safe_dump(values, sort_keys=False))

    @override
    @on_main_process
    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        """Add a row (``step`` as Lightning numbers it: optimizer steps done before this one) and write the file."""
        self.rows.append({"step": step, **values})
        columns = sorted({key for row in self.rows for key in row})
        with open(self.path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)


class _MLflowTracker(MLflowTracker):
    """Accelerate's ``MLflowTracker`` on the recipe's tracking URI (default: a file store in ``output_dir/mlruns``)."""

    def __init__(self, tracking_uri: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tracking_uri = tracking_uri

    @override
    @on_main_process
    def start(self) -> None:
        import mlflow

        mlflow.set_tracking_uri(self.tracking_uri)
        super().start()


def recipe_trackers(recipe: Recipe) -> list[GeneralTracker]:
    """The trackers ``train.loggers`` names, CSV first (always), for ``Accelerator(log_with=...)``."""
    train = recipe.train
    out = Path(train.output_dir)
    version = next_version(out / "logs")
    run = f"version_{version}"
    trackers: list[GeneralTracker] = [CSVTracker(out / "logs", version)]
    if "tensorboard" in train.loggers:
        trackers.append(TensorBoardTracker(run, out / "tensorboard"))
    if "wandb" in train.loggers:
        offline = {"mode": "offline"} if wandb_offline(train) else {}
        trackers.append(WandBTracker(project_name(train), name=run, dir=str(out), **offline))
    if "mlflow" in train.loggers:
        trackers.append(
            _MLflowTracker(mlflow_tracking_uri(train), experiment_name=project_name(train), run_name=run)
        )
    return trackers
