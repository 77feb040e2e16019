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

KTO (:class:`~lightning_plugins.preference.kto.KTOObjective`) runs four forwards of a step, in its order: the policy's
of the KL rows (no gradient), the reference's of the rows and of the KL rows, then the policy's of the rows; its loss
reads nothing back to the host, so the dry run runs it as the run does. Under pipeline parallelism those are the
objective's passes through the schedules (:func:`~lightning_plugins.preference.pipeline.kto_pipeline_objective`): the
three no-grad ones through the forward-only schedule (the KL rows in passes of their own), then the training schedule
with each micro-batch's loss on the last stage. Only TRL's metrics are left out (:func:`_measured_kto`): which of them a
batch logs depends on its labels, read on the host, and they are a few scalars. The step's batch gets its KL rows and
labels here (:func:`with_kl_rows`): each row's KL row is the row before it (a prompt with another completion; as many
tokens as the batch's rows), every other row desirable.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_plugins.preference.options import PreferenceOptions

__all__ = ["run_step", "step_loss"]


def step_loss(
    objective: PreferenceOptions, model: nn.Module, batch: dict[str, Tensor], reference: nn.Module | None = None
) -> Tensor:
    """The loss of one forward of ``model`` on ``batch``, as the run with this ``objective`` computes it
    (``reference``: a full fine-tune's frozen DPO reference)."""
    if objective.unpaired:  # under PP its passes through the schedules, the loss returned detached
        return _measured_kto(objective, reference)(model, with_kl_rows(batch))[0]
    if not objective.paired:
        return model(**batch).loss
    from lightning_plugins.preference.objective import PreferenceObjective

    loss, _ = PreferenceObjective(objective, reference=reference)(model, with_precomputed(objective, batch))
    return loss


def _measured_kto(objective: PreferenceOptions, reference: nn.Module | None) -> Any:
    """:class:`~lightning_plugins.preference.kto.KTOObjective` whose step ends with the loss and the KL estimate
    (tensors only) in place of TRL's metrics, whose names depend on the labels read on the host (not under fake
    tensors)."""
    from lightning_plugins.preference.kto import KTOObjective

    class _MeasuredKTO(KTOObjective):
        def from_kto_logps(self, *logps: Any) -> tuple[Tensor, dict[str, Tensor]]:
            loss, kl, _ = self.loss_of(*logps)
            return loss, {"kl": kl.detach()}

    return _MeasuredKTO(objective, reference=reference)


def with_precomputed(objective: PreferenceOptions, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``batch`` with the reference's log-probabilities of its rows when the run precomputes them (zeros here: the
    step's cost does not depend on their values), else ``batch``."""
    if not objective.needs_reference or objective.reference_per_step:
        return batch
    from lightning_plugins.preference.objective import REFERENCE_KEY

    return {**batch, REFERENCE_KEY: batch["input_ids"].new_zeros(batch["input_ids"].shape[0], dtype=torch.float32)}


def packed_pairs_batch(vocab_size: int, shape: tuple[int, int]) -> dict[str, Tensor]:
    """A batch of packed preference pairs of ``shape`` (rows, tokens), one pair a row
    (:func:`~lightning_plugins.data.packing.pairs_in_rows`), its tensors real under the dry run's fake mode: the
    objective reads each row's pair count and sums by the sequence numbers, and transformers reads the positions for
    the block-diagonal mask of the packed sequences, as the run does."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from lightning_plugins.data.packing import pairs_in_rows

    with unset_fake_temporarily():
        return pairs_in_rows(torch.randint(0, vocab_size, shape))


def with_kl_rows(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """A KTO step's batch from ``batch``'s rows (as sharded for the layout): each row's KL row the previous row's tokens
    (keys prefixed ``kl_``), and ``label`` (every other row desirable), unless ``batch`` has them already."""
    from lightning_plugins.preference.kto import KL_PREFIX

    if "label" in batch:
        return batch
    rows = batch["input_ids"].shape[0]
    kl_rows = {KL_PREFIX + key: value.roll(1, dims=0) for key, value in batch.items() if value.shape[:1] == (rows,)}
    label = torch.arange(rows, device=batch["input_ids"].device) % 2 == 0
    return {**batch, **kl_rows, "label": label}


def run_step(
    objective: PreferenceOptions, model: nn.Module, batch: dict[str, Tensor], reference: nn.Module | None = None
) -> None:
    """Forward and backward of one step on ``batch``, as the run computes it. A model split into pipeline stages runs
    backward inside its call: its own SFT loss, or the preference objective through the schedule (the forward-only
    passes, DPO's reference or KTO's three, then the policy's training pass:
    :mod:`lightning_plugins.preference.pipeline`)."""
    from lightning_plugins.parallel import pipeline_of

    if pipeline_of(model) is None:
        step_loss(objective, model, batch, reference).backward()
    elif objective.paired or objective.unpaired:
        step_loss(objective, model, batch, reference)
    else:
        model(**batch)
