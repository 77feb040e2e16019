"""A batch of preference pairs to its loss and TRL's metrics, under any layout the log-probabilities cover.

A batch holds ``2 * pairs`` rows, the chosen completions first and their rejected ones after, in the same order
(:func:`lightning_plugins.data.packing.collate_pairs`), so both halves of a pair are always in the same
micro-batch on the same data rank; or, packed (``data.packing``), rows of whole pairs whose sequences the batch numbers
in that order (:func:`lightning_plugins.data.packing.collate_packed_pairs`), a pair never split across rows.
The loss is the mean over every pair of the global batch (each rank divides its sum by the global number of pairs, as
the SFT loss does with tokens: :func:`global_mean`), and the metrics are global means, so they read as one process's,
and as TRL's.

The reference of DPO, under LoRA, is the policy's own base: the forward runs with the peft adapters disabled (peft's
``disable_adapter()``) and without gradients; no second copy of the model exists. A full fine-tune has no such base:
its reference is a frozen copy of the starting checkpoint laid out exactly like the policy
(:func:`~lightning_plugins.preference.reference.frozen_reference`, built at the first call unless one is given).

A mixture of experts whose config turns ``output_router_logits`` on adds its router's load-balancing loss, weighted by
the config's ``router_aux_loss_coef``, as TRL's ``DPOTrainer`` adds it (the policy's forward only; logged as
``aux_loss``). TRL turns the term on whenever the config's coefficient is non-zero; here the config's
``output_router_logits`` decides, as it does for SFT.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.context.batch import SEQUENCE_IDS
from lightning_plugins.preference.logps import SequenceLogps, sequence_logps
from lightning_plugins.preference.losses import PairLosses, dpo_losses, orpo_losses, simpo_losses
from lightning_plugins.preference.options import PreferenceOptions
from lightning_plugins.preference.pipeline import find_pipeline, pipeline_objective

#: The batch key of precomputed reference log-probabilities, one per row (the chosen rows', then the rejected rows').
REFERENCE_KEY = "ref_logps"
#: TRL's metric names, in the order they are reduced.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # fmt: skip


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The reference: ``model`` with its peft adapters off (peft's ``disable_adapter()``), restored after."""
    disable = getattr(model, "disable_adapter", None)
    if disable is None:
        raise OptionsError(
            f"objective.method=dpo: {type(model).__name__} is not a peft model whose adapters could be disabled, so"
            " its own base cannot be the reference. Give PreferenceObjective a reference model (`reference=` or"
            " `checkpoint_dir=`: a frozen copy of the starting checkpoint), add a `lora:` section, or use a"
            " reference-free method (objective.method: simpo or orpo)."
        )
    with disable():
        yield


def global_mean(local_sum: Tensor, count: Tensor, mesh: DeviceMesh | None) -> Tensor:
    """This rank's share of the mean over the data ranks: ``local_sum`` divided by the global ``count``, scaled by the
    number of ranks (FSDP2 averages their gradients), its value the global mean on every rank. As the SFT loss's
    :func:`~lightning_plugins.parallel.loss.normalize_over_tokens`, in ``local_sum``'s own dtype."""
    ranks = 1 if mesh is None else mesh.size()
    totals = torch.stack([local_sum.detach(), count.to(local_sum.dtype)])
    if ranks > 1:
        dist.all_reduce(totals, group=mesh.get_group())
    total = totals[1].clamp(min=1)
    scaled = local_sum * (ranks / total)
    return scaled + (totals[0] / total - scaled).detach()


def _global_sums(values: list[Tensor], mesh: DeviceMesh | None) -> Tensor:
    """The sums of ``values`` over the data ranks (one all-reduce), detached, in fp32 at least."""
    dtype = torch.promote_types(values[0].dtype, torch.float32)
    sums = torch.stack([value.detach().to(dtype).sum() for value in values])
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(sums, group=mesh.get_group())
    return sums


class PreferenceObjective:
    """``loss, metrics = objective(model, batch)``: the preference loss of a batch of pairs and TRL's metrics.

    Args:
        options: The method and its settings (the recipe's ``objective:`` section).
        reference: DPO's reference for a full fine-tune (a model laid out like the policy, frozen); ``None``: the
            policy's base with its adapters disabled under LoRA, else a frozen copy built at the first call
            (:func:`~lightning_plugins.preference.reference.frozen_reference`).
        checkpoint_dir: The checkpoint that frozen copy is read from (default: the policy config's ``name_or_path``).
    """

    def __init__(
        self, options: PreferenceOptions, reference: nn.Module | None = None, checkpoint_dir: str | None = None
    ) -> None:
        if not options.paired:
            raise OptionsError(f"PreferenceObjective trains on pairs; objective.method={options.method!r} does not.")
        self.options = options
        self.reference = reference
        self.checkpoint_dir = checkpoint_dir

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        rows = batch["input_ids"].shape[0]
        packed = SEQUENCE_IDS in batch  # packed pairs: one value per sequence, not per row
        if rows % 2 and not packed:
            raise ValueError(f"a preference batch holds chosen rows then rejected rows; got {rows} rows (odd).")
        if packed and find_pipeline(model) is not None:
            raise OptionsError(
                "Packed preference pairs (data.packing) do not run under pipeline parallelism yet: its last stage"
                " scores whole rows. Set data.packing: false (each pair's rows then share a pipeline micro-batch), or"
                " pp_size: 1."
            )
        if REFERENCE_KEY in batch:  # precomputed: the reference's log-probabilities of each row, no forward
            given = batch[REFERENCE_KEY]
            policy = sequence_logps(model, {key: value for key, value in batch.items() if key != REFERENCE_KEY})
            if given.shape != policy.logps.shape:
                what = "sequences" if packed else "rows"
                raise ValueError(f"batch[{REFERENCE_KEY!r}] holds {tuple(given.shape)} values for"
                                 f" {policy.logps.shape[0]} {what}.")  # fmt: skip
            return self.from_logps(policy, replace(policy, logps=given.to(policy.logps), aux_loss=None))
        if find_pipeline(model) is not None:  # split into stages: forward and backward through the schedule
            return pipeline_objective(self, model, batch, adapters_disabled)
        reference = self.reference_logps(model, batch) if self.options.needs_reference else None
        return self.from_logps(sequence_logps(model, batch), reference)

    def reference_logps(self, model: nn.Module, batch: dict[str, Tensor]) -> SequenceLogps:
        """The reference's log-probabilities of ``batch`` (no gradient): the base with the adapters off, or the
        frozen copy (built on the first call, by every rank at once: its loading is collective)."""
        with torch.no_grad():
            copy = self.frozen_copy(model)
            if copy is None:
                with adapters_disabled(model):
                    return sequence_logps(model, batch, router_loss=False)
            from lightning_plugins.preference.reference import reshard

            logps = sequence_logps(copy, batch, router_loss=False)
            reshard(copy)
            return logps

    def frozen_copy(self, model: nn.Module) -> nn.Module | None:
        """The reference when it is a model of its own: the one given, or a frozen copy of the starting checkpoint
        laid out like ``model`` (built at the first call, by every rank at once: its loading is collective); ``None``
        when the reference is ``model``'s base with its adapters disabled."""
        if self.reference is None and getattr(model, "disable_adapter", None) is not None:
            return None
        if self.reference is None:
            from lightning_plugins.preference.reference import frozen_reference

            with torch.inference_mode(False):  # a door may first call it in validation's inference mode
                self.reference = frozen_reference(model, self.checkpoint_dir)
        return self.reference

    def from_logps(
        self, policy: SequenceLogps, reference: SequenceLogps | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss and metrics of log-probabilities already computed (rows: the chosen, then the rejected)."""
        if self.options.needs_reference and reference is None:
            raise ValueError(f"objective.method={self.options.method!r} needs the reference's log-probabilities.")
        pairs, extra = self._pair_losses(policy, reference)
        mesh = policy.data_mesh
        count = torch.tensor(policy.logps.shape[0] // 2, device=pairs.losses.device)
        if self.options.method == "orpo":  # the chosen NLL minus the odds-ratio term
            loss = extra["nll_loss"] - global_mean(pairs.losses.sum(), count, mesh)
        else:
            loss = global_mean(pairs.losses.sum(), count, mesh)
            if "nll_loss" in extra:
                loss = loss + self.options.sft_weight * extra["nll_loss"]
        metrics = self._metrics(policy, pairs, extra)
        if policy.aux_loss is not None and policy.aux_coef:  # TRL: the policy's router balance loss, weighted
            loss = loss + policy.aux_coef * policy.aux_loss
            metrics["aux_loss"] = policy.aux_loss.detach()
        return loss, metrics

    def _pair_losses(
        self, policy: SequenceLogps, reference: SequenceLogps | None
    ) -> tuple[PairLosses, dict[str, Tensor]]:
        options = self.options
        chosen, rejected = policy.logps.chunk(2)
        chosen_tokens, rejected_tokens = policy.tokens.chunk(2)
        if options.method == "dpo":
            assert reference is not None
            ref_chosen, ref_rejected = reference.logps.chunk(2)
            losses = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, options.beta, options.loss_type,
                                options.label_smoothing, chosen_tokens, rejected_tokens)  # fmt: skip
            return losses, {}
        # Reference-free methods score the completions' mean log-probability per token.
        chosen_mean, rejected_mean = chosen / chosen_tokens, rejected / rejected_tokens
        nll = global_mean(-chosen.sum(), chosen_tokens.sum(), policy.data_mesh)
        if options.method == "simpo":
            losses = simpo_losses(
                chosen_mean, rejected_mean, options.beta, options.simpo_gamma, options.label_smoothing
            )
            return losses, ({"nll_loss": nll} if options.sft_weight else {})
        losses, log_odds = orpo_losses(chosen_mean, rejected_mean, options.beta)
        return losses, {"nll_loss": nll, "log_odds_ratio": losses.losses / options.beta, "log_odds_chosen": log_odds}

    def _metrics(self, policy: SequenceLogps, pairs: PairLosses, extra: dict[str, Tensor]) -> dict[str, Tensor]:
        """TRL's metrics, as means over the global batch (the logits: over its completion tokens)."""
        chosen, rejected = policy.logps.chunk(2)
        logits_chosen, logits_rejected = policy.logit_sums.chunk(2)
        tokens_chosen, tokens_rejected = policy.tokens.chunk(2)
        per_pair = [pairs.chosen_rewards, pairs.rejected_rewards,
                    (pairs.chosen_rewards > pairs.rejected_rewards).float(),
                    pairs.chosen_rewards - pairs.rejected_rewards, chosen, rejected]  # fmt: skip
        means = {key: value for key, value in extra.items() if key != "nll_loss"}
        sums = _global_sums(
            per_pair + [logits_chosen, tokens_chosen, logits_rejected, tokens_rejected, torch.ones_like(chosen)]
            + list(means.values()), policy.data_mesh,
        )  # fmt: skip
        pairs_total = sums[10]
        metrics = {name: sums[i] / pairs_total for i, name in enumerate(METRICS)}
        metrics["logits/chosen"] = sums[6] / sums[7].clamp(min=1)
        metrics["logits/rejected"] = sums[8] / sums[9].clamp(min=1)
        metrics.update({key: sums[11 + i] / pairs_total for i, key in enumerate(means)})
        if "nll_loss" in extra:
            metrics["nll_loss"] = extra["nll_loss"].detach()
        return metrics
