"""The loss curve a run writes: drawn without warnings whether or not any loss was logged."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from lightning_plugins.recipe.plots import plot_losses


@pytest.mark.parametrize(
    "metrics",
    ["step,train/loss,val/loss\n1,3.5,\n2,3.4,3.6\n", "\n"],  # losses logged; a run shorter than log_every: none
    ids=["logged", "none"],
)
def test_loss_curve_is_drawn_without_warnings(metrics: str, tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text(metrics)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend" among them
        out = plot_losses(tmp_path / "metrics.csv", tmp_path / "loss_curve.png")
    assert out.stat().st_size > 1000
