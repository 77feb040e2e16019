"""Preference losses under pipeline parallelism: each pair in one pipeline micro-batch, its loss on the last stage.

A pipeline-split model runs its batch through a schedule, one micro-batch at a time, and only the last stage sees
logits. :class:`PreferenceObjective <lightning_plugins.preference.objective.PreferenceObjective>` hands such a model
to :func:`pipeline_objective`, which:

* **keeps pairs together**: the batch (chosen rows, then their rejected rows) is reordered so that micro-batch ``k``
  holds the chosen rows of pairs ``k*q .. k*q+q-1`` then their rejected rows (``q = pairs / pp_microbatches``), the
  layout the objective's per-pair losses read; training needs the pairs to split evenly, evaluation pads with copies
  of the last pair whose rows are dropped from the results;
* **runs the reference first** (DPO: the adapters disabled, or a full fine-tune's frozen copy, split into the same
  stages and shards by the same plan, with schedules of its own; no gradients) through the forward-only schedule with
  the same micro-batches: the last stage keeps each row's summed log-probability (per token from the chunked head, or
  from the logits, vocab-sharded under loss parallel; summed over the context-parallel shards);
* **runs the policy** through the training schedule (:meth:`Pipeline.run_sequences
  <lightning_plugins.parallel.pipeline.runtime.Pipeline.run_sequences>`): the last stage's loss for a micro-batch is
  the sum of its pairs' losses times ``data ranks / pairs of the global batch`` (and an NLL term's chosen-token sum
  times ``data ranks / chosen tokens of the global batch``), so the micro-batches' losses add up to the one-process
  loss (a mean over pairs) exactly as the SFT pipeline loss adds up to a mean over tokens;
* **reports** the loss and TRL's metrics computed by the objective's own :meth:`from_logps` on the last stage from
  every row's (detached) log-probabilities, identical on every rank (one all-reduce over the pipeline ranks).

KTO (:func:`kto_pipeline_objective`, for :class:`~lightning_plugins.preference.kto.KTOObjective`):

* three forward-only passes through the schedule with the same micro-batches (``pp_microbatches`` equal parts of the
  rows; evaluation pads with copies of the last row, dropped from the results): the policy's of the KL rows, then the
  reference's (the adapters disabled, or a full fine-tune's frozen copy in the same stages) of the rows and of the KL
  rows; the last stage keeps each row's summed log-probability, so a KL row never has to travel with its row;
* the KL estimate on the last stage from them (a mean over the global batch's KL rows, clamped at 0, no gradient);
* the policy's training pass: the last stage's loss for a micro-batch is its rows' KTO losses (TRL's two formulas, each
  where the row's label says) times ``data ranks / rows of the global batch``, so the micro-batches add up to the
  one-process mean; TRL's metrics from :meth:`~lightning_plugins.preference.kto.KTOObjective.from_kto_logps` on the
  last stage, on every rank after one all-reduce over the pipeline ranks.

The model is called (``model(..., pipeline_head=head)``), so a door's hooks around the model call (the gradient
hand-off of the Lightning and Accelerate doors) see a training call as for SFT. As there, a training call runs
forward *and* backward: the returned loss is detached, and its gradients are already accumulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.loss import IGNORE_INDEX, next_token_targets
from lightning_plugins.parallel.pipeline.apply import pipeline_of
from lightning_plugins.preference.logps import SequenceLogps, head_logps, sum_over_context
from lightning_plugins.preference.losses import kto_losses

if TYPE_CHECKING:
    from lightning_plugins.parallel.pipeline.runtime import Pipeline

__all__ = ["find_pipeline", "kto_pipeline_objective", "pipeline_objective"]


def find_pipeline(model: nn.Module) -> tuple[nn.Module, Pipeline] | None:
    """The causal LM inside ``model`` (a peft model, or a module holding one) that is split into pipeline stages,
    and its :class:`Pipeline`; ``None`` without pipeline parallelism."""
    for module in model.modules():
        pipeline = pipeline_of(module)
        if pipeline is not None:
            return module, pipeline
    return None


@dataclass(frozen=True)
class _Order:
    """Where each row of the reordered batch comes from: ``take`` indexes the given batch, ``rows`` is the row it
    stands for (``-1``: a copy that pads evaluation to whole micro-batches)."""

    take: Tensor
    rows: Tensor


def _micro_batch_order(count: int, microbatches: int, train: bool, device: torch.device, halves: int) -> _Order:
    """``count`` items in ``microbatches`` equal parts: KTO's rows (``halves=1``), or pairs (``halves=2``: pair ``i``
    is row ``i``, its chosen, and row ``count + i``, its rejected), micro-batch ``k`` holding the chosen rows of its
    pairs then their rejected rows. Training needs equal parts; evaluation pads with copies of the last item."""
    if count % microbatches and train:
        what = (f"a preference pair's chosen and rejected rows travel in one micro-batch, so the {count} pairs"
                if halves == 2 else f"KTO's {count} rows")  # fmt: skip
        raise OptionsError(
            f"Under pipeline parallelism {what} of this data rank's batch must split into"
            f" pp_microbatches={microbatches} equal parts. Use a batch {'of pairs ' if halves == 2 else ''}per data"
            f" rank (train.micro_batch_size) that is a multiple of {microbatches}, or pp_microbatches dividing {count}."
        )
    per = -(-count // microbatches)
    take, rows = [], []
    for k in range(microbatches):
        items = range(k * per, (k + 1) * per)
        for half in range(halves):
            take += [half * count + min(i, count - 1) for i in items]
            rows += [half * count + i if i < count else -1 for i in items]
    return _Order(torch.tensor(take, device=device), torch.tensor(rows, device=device))


def _take(rows: SequenceLogps, index: Tensor) -> SequenceLogps:
    return replace(rows, logps=rows.logps[index], tokens=rows.tokens[index], logit_sums=rows.logit_sums[index])


class _LastStageHead:
    """The last stage's work per micro-batch (:meth:`Pipeline.run_sequences`' ``head``): each row's statistics,
    kept (detached) by the row they stand for, and with ``loss`` the micro-batch's differentiable loss."""

    def __init__(
        self, order: _Order, context: DeviceMesh | None, loss: Callable[[SequenceLogps, Tensor], Tensor] | None = None
    ) -> None:
        self.order, self.context, self.loss = order, context, loss
        self.parts: list[tuple[Tensor, SequenceLogps]] = []

    def __call__(self, logits: Tensor, targets: Tensor, chunked: Any, positions: Tensor) -> Tensor:
        part = sum_over_context(head_logps(logits, targets, chunked), self.context)
        rows = self.order.rows[positions]
        self.parts.append((rows, replace(part, logps=part.logps.detach())))
        if self.loss is None:
            return torch.zeros((), dtype=torch.float32, device=targets.device)
        return self.loss(part, rows).float()

    def rows(self, count: int, data_mesh: DeviceMesh | None) -> SequenceLogps:
        """The ``count`` rows of the given batch, in its order (padding dropped; no shape depends on the values, so
        the planner's fake tensors take it too)."""
        rows = torch.cat([r for r, _ in self.parts])
        slots = torch.where(rows < 0, count, rows)  # padding goes to one extra slot, cut off
        stats = []
        for name in ("logps", "tokens", "logit_sums"):
            values = torch.cat([getattr(part, name) for _, part in self.parts])
            stats.append(values.new_zeros(count + 1).index_copy(0, slots, values)[:count])
        return SequenceLogps(*stats, data_mesh=data_mesh)


@dataclass(frozen=True)
class _MicroBatchLoss:
    """A micro-batch's share of the global loss: its pairs' losses (and an NLL term's chosen-token sum), each
    divided by its count over the global batch and scaled by the data ranks (FSDP2 averages their gradients), as
    :func:`~lightning_plugins.preference.objective.global_mean` scales the whole batch's."""

    objective: Any  # a PreferenceObjective (which imports this module)
    reference: SequenceLogps | None
    per_pair: Tensor
    per_chosen_token: Tensor

    def __call__(self, part: SequenceLogps, rows: Tensor) -> Tensor:
        reference = None if self.reference is None else _take(self.reference, rows)
        pairs, extra = self.objective._pair_losses(part, reference)
        loss = pairs.losses.sum() * self.per_pair
        if "nll_loss" in extra:  # ORPO: the chosen NLL minus the odds-ratio term; SimPO: plus the weighted NLL
            nll = -part.logps.chunk(2)[0].sum() * self.per_chosen_token
            options = self.objective.options
            loss = nll - loss if options.method == "orpo" else loss + options.sft_weight * nll
        return loss


def _meshes(pipeline: Pipeline) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The data ranks (``dp_cp``) and the context-parallel ranks of the pipeline's mesh (``None``: one)."""
    mesh = pipeline.mesh
    data, context = mesh["dp_cp"], mesh["cp"]
    return (data if data.size() > 1 else None), (context if context.size() > 1 else None)


def _loss_factors(batch: dict[str, Tensor], pairs: int, data: DeviceMesh | None, cp: int) -> tuple[Tensor, Tensor]:
    """``data ranks / pairs`` and ``data ranks / chosen tokens``, both counted over the global batch as the objective
    counts them (every row once per context-parallel rank)."""
    targets = batch.get("shift_labels")
    targets = next_token_targets(batch["labels"]) if targets is None else targets
    chosen_tokens = (targets[:pairs] != IGNORE_INDEX).sum() * cp  # a shard's tokens; all shards hold the row
    totals = torch.stack([torch.tensor(pairs, device=targets.device), chosen_tokens]).to(torch.float64)
    ranks = 1
    if data is not None:
        dist.all_reduce(totals, group=data.get_group())
        ranks = data.size()
    return (ranks / totals[0].clamp(min=1)).float(), (ranks / totals[1].clamp(min=1)).float()


def _reordered(batch: dict[str, Tensor], order: _Order) -> dict[str, Tensor]:
    rows = batch["input_ids"].shape[0]
    return {key: value.index_select(0, order.take) if value.ndim and value.shape[0] == rows and rows > 1 else value
            for key, value in batch.items()}  # fmt: skip


def pipeline_objective(
    objective: Any, model: nn.Module, batch: dict[str, Tensor], reference: Callable[[nn.Module], AbstractContextManager]
) -> tuple[Tensor, dict[str, Tensor]]:
    """The preference loss and TRL's metrics of ``batch`` on a pipeline-split ``model``: training (``model`` in
    training mode, gradients on) runs forward and backward and returns the loss detached; otherwise forward only.

    Args:
        objective: The :class:`~lightning_plugins.preference.objective.PreferenceObjective`.
        model: The model it was called with.
        batch: Its batch of pairs (chosen rows, then their rejected rows).
        reference: Turns ``model`` into the reference within its context (the adapters disabled), for a method
            that needs one.
    """
    found = find_pipeline(model)
    assert found is not None
    causal_lm, pipeline = found
    rows = batch["input_ids"].shape[0]
    pairs = rows // 2
    train = causal_lm.training and torch.is_grad_enabled()
    order = _micro_batch_order(pairs, pipeline.options.microbatches or 1, train, batch["input_ids"].device, 2)
    data, context = _meshes(pipeline)
    last = any(stage.is_last for stage in pipeline.stages.values())
    given = _reordered(batch, order)
    ref_rows = None
    if objective.options.needs_reference:
        head = _LastStageHead(order, context)
        with torch.no_grad():
            _reference_pass(objective, model, reference, given, head)
        ref_rows = head.rows(rows, data) if last else None
    loss_fn = None
    if train and last:
        cp = 1 if context is None else context.size()
        loss_fn = _MicroBatchLoss(objective, ref_rows, *_loss_factors(batch, pairs, data, cp))
    head = _LastStageHead(order, context, loss_fn)
    with contextlib.nullcontext() if train else torch.no_grad():
        model(**given, use_cache=False, pipeline_head=head)
    if last:
        loss, metrics = objective.from_logps(head.rows(rows, data), ref_rows)
    else:  # the same names (the objective's, for its options), zeros: the last stage's values arrive below
        loss, metrics = _names_only(objective, batch["input_ids"].device)
    return _from_last_stage(pipeline, loss.detach(), metrics)


def _reference_pass(
    objective: Any, model: nn.Module, reference: Callable[[nn.Module], AbstractContextManager],
    given: dict[str, Tensor], head: Any,
) -> None:  # fmt: skip
    """DPO's reference through the forward-only schedule: the policy with its LoRA adapters disabled, or a full
    fine-tune's frozen copy, split into the same stages as the policy (its own schedules), resharded after."""
    copy = objective.frozen_copy(model)
    if copy is None:
        with reference(model):
            model(**given, use_cache=False, pipeline_head=head)
        return
    from lightning_plugins.preference.reference import reshard

    copy(**given, use_cache=False, pipeline_head=head)
    reshard(copy)


def _names_only(objective: Any, device: torch.device) -> tuple[Tensor, dict[str, Tensor]]:
    ones = torch.ones(2, device=device)
    rows = SequenceLogps(-ones, ones, ones)
    with torch.no_grad():
        loss, metrics = objective.from_logps(rows, rows if objective.options.needs_reference else None)
    return torch.zeros_like(loss), {key: torch.zeros_like(value) for key, value in metrics.items()}


def _from_last_stage(pipeline: Pipeline, loss: Tensor, metrics: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """The last stage's loss and metrics on every pipeline rank (the others hold zeros: one all-reduce)."""
    values = torch.stack([loss.float(), *(value.detach().float() for value in metrics.values())])
    dist.all_reduce(values, group=pipeline.pp_mesh.get_group())
    return values[0], dict(zip(metrics, values[1:]))


class _KTOMicroBatchLoss:
    """A micro-batch's share of the global KTO loss (its rows' losses times ``data ranks / global rows``)."""

    def __init__(self, objective: Any, reference: SequenceLogps, kl: Tensor, good: Tensor, per_row: Tensor) -> None:
        self.objective, self.reference, self.kl, self.good, self.per_row = objective, reference, kl, good, per_row

    def __call__(self, part: SequenceLogps, rows: Tensor) -> Tensor:
        options = self.objective.options
        reference = self.reference.logps[rows]
        every = kto_losses(part.logps, part.logps, reference, reference, self.kl, options.beta,
                           options.desirable_weight, options.undesirable_weight)  # fmt: skip
        desirable, undesirable = every.losses.chunk(2)
        return torch.where(self.good[rows], desirable, undesirable).sum() * self.per_row


def _kto_per_row(rows: int, data: DeviceMesh | None, device: torch.device) -> Tensor:
    """``data ranks / rows of the global batch`` (every row counted once per context-parallel rank, as the
    objective's mean over ``dp_cp`` counts it)."""
    total = torch.tensor(float(rows), dtype=torch.float64, device=device)
    ranks = 1
    if data is not None:
        dist.all_reduce(total, group=data.get_group())
        ranks = data.size()
    return (ranks / total.clamp(min=1)).float()


def kto_pipeline_objective(
    objective: Any, model: nn.Module, rows: dict[str, Tensor], kl_rows: dict[str, Tensor], label: Tensor,
    reference: Any,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """KTO's loss and TRL's metrics on a pipeline-split ``model`` (training: forward and backward, the loss returned
    detached). ``rows`` / ``kl_rows``: the batch's rows and KL rows; ``reference``: the adapters-disabled context."""
    found = find_pipeline(model)
    assert found is not None
    causal_lm, pipeline = found
    count = rows["input_ids"].shape[0]
    train = causal_lm.training and torch.is_grad_enabled()
    order = _micro_batch_order(count, pipeline.options.microbatches or 1, train, rows["input_ids"].device, 1)
    data, context = _meshes(pipeline)
    last = any(stage.is_last for stage in pipeline.stages.values())
    given, kl_given = _reordered(rows, order), _reordered(kl_rows, order)

    def forward_only(inputs: dict[str, Tensor], of_reference: bool) -> SequenceLogps | None:
        head = _LastStageHead(order, context)
        with torch.no_grad():
            if of_reference:
                _reference_pass(objective, model, reference, inputs, head)
            else:
                model(**inputs, use_cache=False, pipeline_head=head)
        return head.rows(count, data) if last else None

    policy_kl = forward_only(kl_given, False)
    ref_rows, ref_kl = forward_only(given, True), forward_only(kl_given, True)
    good = label.to(rows["input_ids"].device).bool()
    loss_fn = None
    if train and last:
        kl = objective.kl_estimate(policy_kl, ref_kl)
        loss_fn = _KTOMicroBatchLoss(objective, ref_rows, kl, good, _kto_per_row(count, data, good.device))
    head = _LastStageHead(order, context, loss_fn)
    with contextlib.nullcontext() if train else torch.no_grad():
        model(**given, use_cache=False, pipeline_head=head)
    if last:
        loss, metrics = objective.from_kto_logps(head.rows(count, data), ref_rows, policy_kl, ref_kl, label)
    else:  # the same names (they depend on the global batch's labels only), zeros: the last stage's values arrive
        zeros, ones = torch.zeros(count, device=good.device), torch.ones(count, device=good.device)
        rows_of = SequenceLogps(zeros, ones, zeros, data_mesh=data)  # every row holds a token, as on the last stage
        with torch.no_grad():
            loss, metrics = objective.from_kto_logps(rows_of, rows_of, rows_of, rows_of, label)
        loss, metrics = torch.zeros_like(loss), {key: torch.zeros_like(value) for key, value in metrics.items()}
    return _from_last_stage(pipeline, loss.detach(), metrics)
