"""Preference losses on sequence log-probabilities, as TRL defines them (TRL 1.16).

Each function takes per-sequence log-probabilities (summed over the completion's tokens, or averaged where the method
says so) and returns the per-pair (or per-example) losses and the rewards TRL logs; the caller averages. What each
follows in TRL:

* :func:`dpo_losses`: ``DPOTrainer._compute_loss`` with ``loss_type`` ``sigmoid``, ``robust`` (label smoothing read as
  the probability a label is flipped) and ``ipo`` (TRL's per-token normalisation of the log-ratios by the completion
  lengths); rewards ``beta * (policy - reference)``.
* :func:`simpo_losses`: ``CPOTrainer.cpo_loss`` with ``loss_type="simpo"`` (length-averaged log-probabilities, margin
  ``gamma``, label smoothing), no reference; rewards ``beta * logps``.
* :func:`orpo_losses`: ``ORPOTrainer.odds_ratio_loss`` (length-averaged log-probabilities): the odds-ratio term
  ``beta * logsigmoid(log_odds)``, which the full loss *subtracts* from the chosen completions' token-mean NLL.
* :func:`kto_losses`: ``KTOTrainer._compute_loss`` with ``loss_type="kto"`` (unpaired: desirable and undesirable
  examples, the batch's reference KL estimate ``kl``, clamped at 0 by the caller as TRL does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["PairLosses", "dpo_losses", "kto_losses", "log1mexp", "orpo_losses", "simpo_losses"]


@dataclass(frozen=True)
class PairLosses:
    """Per-pair losses (to be averaged) and the rewards TRL logs (detached)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


def dpo_losses(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: Tensor | None = None,
    rejected_tokens: Tensor | None = None,
) -> PairLosses:
    """DPO and its variants on summed log-probabilities (``[pairs]`` each).

    Args:
        chosen, rejected: The policy's summed completion log-probabilities.
        ref_chosen, ref_rejected: The reference's.
        beta: The KL coefficient (IPO's tau).
        loss_type: ``sigmoid`` (DPO), ``robust`` (robust DPO, needs ``label_smoothing`` in [0, 0.5)) or ``ipo``.
        label_smoothing: ``robust``: the probability that a pair's label is flipped.
        chosen_tokens, rejected_tokens: Completion token counts (``ipo`` divides the log-ratios by them).
    """
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("loss_type='ipo' needs the completions' token counts (chosen_tokens, rejected_tokens).")
        average = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (average - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}: use sigmoid, robust or ipo.")
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def simpo_losses(
    chosen_mean: Tensor, rejected_mean: Tensor, beta: float, gamma: float, label_smoothing: float = 0.0
) -> PairLosses:
    """SimPO on length-averaged log-probabilities (no reference): a margin ``gamma`` between the scaled averages."""
    logits = (chosen_mean - rejected_mean) - gamma / beta
    losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    return PairLosses(losses, beta * chosen_mean.detach(), beta * rejected_mean.detach())


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation on either side of ``-log 2``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_losses(chosen_mean: Tensor, rejected_mean: Tensor, beta: float) -> tuple[PairLosses, Tensor]:
    """ORPO's odds-ratio term ``beta * logsigmoid(log_odds)`` per pair (the full loss is the chosen NLL *minus* its
    mean) on length-averaged log-probabilities, and the log odds (TRL logs their mean as ``log_odds_chosen``)."""
    chosen_mean, rejected_mean = chosen_mean.float(), rejected_mean.float()
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    terms = beta * F.logsigmoid(log_odds)
    return PairLosses(terms, beta * chosen_mean.detach(), beta * rejected_mean.detach()), log_odds.detach()


def kto_losses(
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    kl: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PairLosses:
    """KTO on unpaired examples: ``chosen`` are the desirable ones' summed log-probabilities, ``rejected`` the
    undesirable ones' (either may be empty); ``losses`` is both sets' weighted losses, desirable first."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    chosen_losses = 1 - torch.sigmoid(beta * (chosen_ratio - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_ratio))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
