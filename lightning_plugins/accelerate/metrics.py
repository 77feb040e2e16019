"""Metrics of a recipe run written as Lightning's ``CSVLogger`` writes them, so both doors' runs plot alike.

``output_dir/logs/version_<N>/metrics.csv`` (one version per attempt), columns sorted by name, one row per
log call with ``epoch`` and ``step``: what :func:`lightning_plugins.plots.merge_metrics` reads.
"""

from __future__ import annotations

import csv
from pathlib import Path


class MetricsCSV:
    """Rows of metrics for one attempt, rewritten to ``log_root/version_<N>/metrics.csv`` on every flush.

    Args:
        log_root: The ``logs`` directory; the first free ``version_<N>`` below it is this attempt's.
    """

    def __init__(self, log_root: str | Path) -> None:
        root = Path(log_root)
        versions = [int(p.name.split("_")[1]) for p in root.glob("version_*") if p.name.split("_")[1].isdigit()]
        self.path = root / f"version_{max(versions, default=-1) + 1}" / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, float | int]] = []

    def log(self, metrics: dict[str, float], *, step: int, epoch: int) -> None:
        """Add a row (``step`` as Lightning numbers it: optimizer steps done before this one) and write the file."""
        self.rows.append({"epoch": epoch, "step": step, **metrics})
        columns = sorted({key for row in self.rows for key in row})
        with open(self.path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
