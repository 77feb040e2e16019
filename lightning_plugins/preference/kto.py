"""KTO on unpaired examples: a batch of completions, each desirable or not, to its loss and TRL's metrics.

A batch (:func:`~lightning_plugins.data.preference.collate_unpaired`) holds, per example, its row (prompt +
completion, the completion labelled) and its KL row: the same prompt with the completion of the example before it in
the same micro-batch (the first takes the last's), TRL's mismatched pairs for the KL estimate, and ``label`` (``True``:
desirable). As TRL's ``KTOTrainer`` (``loss_type="kto"``, TRL 1.16):

* the policy's log-probabilities of the rows (with gradient) and of the KL rows (without), the reference's of both;
* ``kl``: the mean over the KL rows of ``policy - reference``, clamped at 0, no gradient (TRL averages each rank's
  mean; here the mean over every KL row of the global batch, which is what one process of TRL computes);
* the loss: :func:`~lightning_plugins.preference.losses.kto_losses`, averaged over the examples of the global batch;
* metrics: ``rewards/chosen`` and ``logps/chosen`` over the desirable examples, ``.../rejected`` over the undesirable
  ones, ``rewards/margins`` (when both exist), ``logits/*`` per completion token, and ``kl``.

What differs from TRL: TRL rotates the completions within each batch of ``per_device_train_batch_size`` examples in
dataset order, before the loader shuffles; here within each micro-batch as the loader hands it over, so that a batch's
KL completions are its own completions (what TRL's comment asks for). Either way the estimate depends on how the batch
is cut. The reference is :class:`~lightning_plugins.preference.objective.PreferenceObjective`'s: the base with the
adapters disabled under LoRA, else a frozen copy.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.context.batch import COMPANION_PREFIX
from lightning_plugins.preference.logps import SequenceLogps, sequence_logps
from lightning_plugins.preference.losses import PairLosses, kto_losses
from lightning_plugins.preference.objective import PreferenceObjective, adapters_disabled, global_mean
from lightning_plugins.preference.options import PreferenceOptions
from lightning_plugins.preference.pipeline import find_pipeline, kto_pipeline_objective

__all__ = ["KL_PREFIX", "KTOObjective"]

#: The batch keys of the KL rows: ``kl_input_ids``, ``kl_attention_mask``, ``kl_labels``: the companion rows that
#: :func:`~lightning_plugins.parallel.context.shard_batch_for_context_parallel` shards alike under context parallelism.
KL_PREFIX = COMPANION_PREFIX
#: A row's keys (and, prefixed, its KL row's): as collated, or as context parallelism shards them.
_ROW_KEYS = ("input_ids", "attention_mask", "labels", "shift_labels", "position_ids")


def _sums(values: list[Tensor], mesh: DeviceMesh | None) -> Tensor:
    """The sums of ``values`` over the data ranks (one all-reduce), detached, in fp64."""
    sums = torch.stack([value.detach().double().sum() for value in values])
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(sums, group=mesh.get_group())
    return sums


class KTOObjective(PreferenceObjective):
    """``loss, metrics = objective(model, batch)``: KTO's loss of a batch of unpaired examples and TRL's metrics.

    Args:
        options: ``method="kto"`` and its ``beta``, ``desirable_weight``, ``undesirable_weight``.
        reference, checkpoint_dir: As :class:`~lightning_plugins.preference.objective.PreferenceObjective`'s.
    """

    def __init__(
        self, options: PreferenceOptions, reference: nn.Module | None = None, checkpoint_dir: str | None = None
    ) -> None:
        if not options.unpaired:
            raise OptionsError(
                f"KTOObjective trains on unpaired examples; objective.method={options.method!r} does not."
            )
        self.options, self.reference, self.checkpoint_dir = options, reference, checkpoint_dir

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if find_pipeline(model) is not None:  # split into stages: the passes through the schedule
            self._check(batch)
            rows = {key: batch[key] for key in _ROW_KEYS if key in batch}
            kl_rows = {key: batch[KL_PREFIX + key] for key in _ROW_KEYS if KL_PREFIX + key in batch}
            return kto_pipeline_objective(self, model, rows, kl_rows, batch["label"], adapters_disabled)
        return self.from_kto_logps(*self.forwards(model, batch), batch["label"])

    @staticmethod
    def _check(batch: dict[str, Tensor]) -> None:
        missing = [key for key in ("label", f"{KL_PREFIX}input_ids") if key not in batch]
        if missing or not {"labels", "shift_labels"} & set(batch):
            raise ValueError(
                f"a KTO batch (collate_unpaired) holds rows, KL rows and labels; {missing or ['labels']} missing."
            )

    def kl_estimate(self, policy_kl: SequenceLogps, reference_kl: SequenceLogps) -> Tensor:
        """The KL estimate: the mean of ``policy - reference`` over the global batch's KL rows, clamped at 0."""
        mesh = policy_kl.data_mesh
        kl_sum, kl_rows = _sums([policy_kl.logps - reference_kl.logps, torch.ones_like(policy_kl.logps)], mesh)
        return (kl_sum / kl_rows.clamp(min=1.0)).clamp(min=0.0).to(policy_kl.logps.dtype)

    def forwards(
        self, model: nn.Module, batch: dict[str, Tensor]
    ) -> tuple[SequenceLogps, SequenceLogps, SequenceLogps, SequenceLogps]:
        """The four forwards of a step, in the order they run: the policy's of the KL rows (no gradient), the
        reference's of the rows and of the KL rows, then the policy's of the rows (with gradient). Returned as
        ``policy, reference, policy_kl, reference_kl``."""
        self._check(batch)
        rows = {key: batch[key] for key in _ROW_KEYS if key in batch}
        kl_rows = {key: batch[KL_PREFIX + key] for key in _ROW_KEYS if KL_PREFIX + key in batch}
        with torch.no_grad():
            policy_kl = sequence_logps(model, kl_rows, router_loss=False)
        reference, reference_kl = self.reference_logps(model, rows), self.reference_logps(model, kl_rows)
        return sequence_logps(model, rows), reference, policy_kl, reference_kl

    def loss_of(
        self,
        policy: SequenceLogps,
        reference: SequenceLogps,
        policy_kl: SequenceLogps,
        reference_kl: SequenceLogps,
        label: Tensor,
    ) -> tuple[Tensor, Tensor, PairLosses]:
        """The loss (this rank's share of the global mean, the router loss added), the KL estimate and each row's
        rewards, in tensors only: nothing is read back to the host (so a dry run on fake tensors runs it too)."""
        options, mesh = self.options, policy.data_mesh
        good = label.to(policy.logps.device).bool()
        kl = self.kl_estimate(replace(policy_kl, data_mesh=mesh), reference_kl).to(policy.logps.dtype)
        # TRL's two formulas, each taken where the row's label says (TRL: on the desirable rows, the undesirable rows).
        every = kto_losses(policy.logps, policy.logps, reference.logps, reference.logps, kl, options.beta,
                           options.desirable_weight, options.undesirable_weight)  # fmt: skip
        desirable, undesirable = every.losses.chunk(2)
        losses = replace(every, losses=torch.where(good, desirable, undesirable))
        loss = global_mean(losses.losses.sum(), torch.tensor(label.numel(), device=good.device), mesh)
        if policy.aux_loss is not None and policy.aux_coef:  # TRL: the policy's router balance loss, weighted
            loss = loss + policy.aux_coef * policy.aux_loss
        return loss, kl, losses

    def from_kto_logps(
        self,
        policy: SequenceLogps,
        reference: SequenceLogps,
        policy_kl: SequenceLogps,
        reference_kl: SequenceLogps,
        label: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss and metrics of log-probabilities already computed (``label``: ``True`` for a desirable row)."""
        loss, kl, losses = self.loss_of(policy, reference, policy_kl, reference_kl, label)
        good = label.to(policy.logps.device).bool()
        sums = _sums(
            [losses.chosen_rewards[good], policy.logps[good], good.float(), losses.rejected_rewards[~good],
             policy.logps[~good], (~good).float(), policy.logit_sums[good], policy.tokens[good],
             policy.logit_sums[~good], policy.tokens[~good]], policy.data_mesh,
        ).tolist()  # fmt: skip
        metrics: dict[str, Tensor] = {"kl": kl.detach()}
        value = policy.logps.new_tensor
        if sums[2] > 0:
            metrics.update({"rewards/chosen": value(sums[0] / sums[2]), "logps/chosen": value(sums[1] / sums[2])})
        if sums[5] > 0:
            metrics.update({"rewards/rejected": value(sums[3] / sums[5]), "logps/rejected": value(sums[4] / sums[5])})
        if sums[2] > 0 and sums[5] > 0:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        if sums[7] > 0:
            metrics["logits/chosen"] = value(sums[6] / sums[7])
        if sums[9] > 0:
            metrics["logits/rejected"] = value(sums[8] / sums[9])
        if policy.aux_loss is not None and policy.aux_coef:
            metrics["aux_loss"] = policy.aux_loss.detach()
        return loss, metrics
