"""The metrics of a run (merged over resumed attempts) and its loss curve, from Lightning's ``CSVLogger`` files."""

from __future__ import annotations

import csv
from pathlib import Path


def merge_metrics(log_root: str | Path, out_csv: str | Path) -> Path:
    """Join ``log_root/version_*/metrics.csv`` (one per attempt) into ``out_csv``, ordered by step.

    A resumed attempt repeats the steps after its checkpoint; its rows replace the earlier attempt's.
    """
    attempts = sorted(Path(log_root).glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[-1]))
    rows: list[dict[str, str]] = []
    columns: list[str] = []
    for path in attempts:
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            new = list(reader)
            columns += [c for c in reader.fieldnames or () if c not in columns]
        first = min((int(r["step"]) for r in new), default=None)
        rows = [r for r in rows if first is None or int(r["step"]) < first] + new
    out = Path(out_csv)
    with open(out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return out


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
    axes.grid(alpha=0.3)
    if any(series.values()):
        axes.legend()
    else:  # a run shorter than train.log_every logged no loss: say so rather than draw an empty legend
        axes.text(0.5, 0.5, "no loss logged (a run shorter than train.log_every)", ha="center", transform=axes.transAxes)
    figure.tight_layout()
    out = Path(out_png)
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out
