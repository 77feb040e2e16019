"""The loss one measured step backpropagates: the model's own (SFT) or the recipe's preference objective's.

A dry run and the real runs it is checked against call :func:`step_loss` (:func:`run_step`), so a preference step is measured as it
runs, not modelled: :class:`~lightning_plugins.preference.PreferenceObjective` on a batch of chosen rows then rejected
rows (a recipe's ``micro_batch_size`` pairs are twice as many rows: :meth:`Workload.from_recipe
<lightning_plugins.planner.workload.Workload.from_recipe>`), DPO's reference forward first (the base with the
adapters disabled, under ``no_grad``: its transient activations, none kept), then the policy's forward through the
per-token loss path. SimPO and ORPO have no reference forward. A full fine-tune's DPO reference is a frozen copy of the
model laid out like it (:func:`~lightning_plugins.preference.reference.frozen_reference`): the dry run builds it
as it builds the policy and tracks its parameters, and its forward is the reference forward measured. With
``objective.reference: precomputed`` the step has no reference: neither a copy nor a forward, its batch carries the
reference's log-probabilities (``ref_logps``, one value a row) as the run's batches do.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_plugins.preference.options import PreferenceOptions

__all__ = ["run_step", "step_loss"]


def step_loss(
    objective: PreferenceOptions, model: nn.Module, batch: dict[str, Tensor], reference: nn.Module | None = None
) -> Tensor:
    """The loss of one forward of ``model`` on ``batch``, as the run with this ``objective`` computes it
    (``reference``: a full fine-tune's frozen DPO reference)."""
    if not objective.paired:
        return model(**batch).loss
    from lightning_plugins.preference.objective import PreferenceObjective

    loss, _ = PreferenceObjective(objective, reference=reference)(model, with_precomputed(objective, batch))
    return loss


def with_precomputed(objective: PreferenceOptions, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``batch`` with the reference's log-probabilities of its rows when the run precomputes them (zeros here: the
    step's cost does not depend on their values), else ``batch``."""
    if not objective.needs_reference or objective.reference_per_step:
        return batch
    from lightning_plugins.preference.objective import REFERENCE_KEY

    return {**batch, REFERENCE_KEY: batch["input_ids"].new_zeros(batch["input_ids"].shape[0], dtype=torch.float32)}


def run_step(
    objective: PreferenceOptions, model: nn.Module, batch: dict[str, Tensor], reference: nn.Module | None = None
) -> None:
    """Forward and backward of one step on ``batch``, as the run computes it. A model split into pipeline stages runs
    backward inside its call: its own SFT loss, or the preference objective through the schedule (the reference's
    forward-only pass, then the policy's training pass: :mod:`lightning_plugins.preference.pipeline`)."""
    from lightning_plugins.parallel import pipeline_of

    if pipeline_of(model) is None:
        step_loss(objective, model, batch, reference).backward()
    elif objective.paired:
        from lightning_plugins.preference.objective import PreferenceObjective

        PreferenceObjective(objective, reference=reference)(model, batch)
    else:
        model(**batch)
