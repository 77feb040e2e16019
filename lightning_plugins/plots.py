"""The loss curve of a run, drawn from the metrics CSV Lightning's ``CSVLogger`` writes."""

from __future__ import annotations

import csv
from pathlib import Path


def plot_losses(metrics_csv: str | Path, out_png: str | Path) -> Path:
    """Draw ``train/loss`` (and ``val/loss`` where logged) against the optimizer step into ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {"train/loss": [], "val/loss": []}
    with open(metrics_csv, newline="") as handle:
        for row in csv.DictReader(handle):
            for key, points in series.items():
                if row.get(key):
                    points.append((int(row["step"]), float(row[key])))
    figure, axes = plt.subplots(figsize=(7, 4))
    for key, points in series.items():
        if points:
            steps, values = zip(*points)
            axes.plot(steps, values, marker="o" if key == "val/loss" else None, label=key)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    out = Path(out_png)
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out
