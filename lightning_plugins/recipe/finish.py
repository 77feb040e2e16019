"""How both doors end a recipe run: the trained model exported (HF directory, or peft adapter and merged weights),
then, on the main process, ``run.json`` told what was written, the attempts' metrics merged into
``output_dir/metrics.csv`` and the loss curve drawn into ``output_dir/loss_curve.png``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_plugins.recipe.schema import Recipe


def check_exportable(parameters: Iterable[torch.nn.Parameter], recipe: Recipe, step: int) -> None:
    """Refuse to export weights that are not finite (:func:`~lightning_plugins.run.nonfinite.check_finite_weights`)."""
    from lightning_plugins.run.nonfinite import check_finite_weights, training_state

    check_finite_weights(training_state(parameters), f"export to {Path(recipe.train.output_dir)}", step)


def export_dir(recipe: Recipe) -> Path:
    """Where the trained model is exported: ``output_dir/adapter`` (LoRA) or ``output_dir/hf``."""
    return Path(recipe.train.output_dir) / ("adapter" if recipe.lora else "hf")


def export_trained(model: torch.nn.Module, tokenizer: Any, recipe: Recipe) -> dict[str, Path]:
    """Export the trained (sharded) model, and the merged weights when ``train.merge_lora`` (collective).

    Returns:
        ``model`` (and ``merged``): the directories written.
    """
    from lightning_plugins.checkpoint.live_export import export_hf

    written = {"model": export_hf(model, export_dir(recipe), tokenizer)}
    if recipe.lora is not None and recipe.train.merge_lora:
        written["merged"] = export_hf(model, Path(recipe.train.output_dir) / "merged", tokenizer, merge=True)
    return written


def write_results(
    recipe: Recipe, written: Mapping[str, Path], resumed_from: str | Path | None, last: Mapping[str, float]
) -> dict[str, Any]:
    """On the main process: record ``written`` in ``run.json``, merge the metrics, draw the loss curve.

    Returns:
        The paths written (``written``, ``metrics``, ``loss_curve``), ``resumed_from`` and the ``last`` metrics.
    """
    from lightning_plugins.recipe.plots import merge_metrics, plot_losses
    from lightning_plugins.recipe.manifest import attach_manifest

    out = Path(recipe.train.output_dir)
    attach_manifest(out, written.values())
    results: dict[str, Any] = dict(written)
    results["metrics"] = merge_metrics(out / "logs", out / "metrics.csv")
    results["loss_curve"] = plot_losses(results["metrics"], out / "loss_curve.png")
    return {**results, "resumed_from": resumed_from, **last}
