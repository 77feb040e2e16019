"""The recipe's ``objective:`` section: what the run optimizes (SFT, or a preference method and its settings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_plugins.errors import OptionsError

#: Methods that train on chosen/rejected pairs.
PAIRED = ("dpo", "simpo", "orpo")
#: Methods that train on unpaired examples (a completion and whether it is desirable).
UNPAIRED = ("kto",)
#: Methods whose loss compares the policy with a reference model.
NEEDS_REFERENCE = ("dpo", "kto")


@dataclass(frozen=True)
class PreferenceOptions:
    """What the run optimizes. ``method: sft`` (the default) trains on prompt/completion or chat records; the
    preference methods train on chosen/rejected pairs (TRL's ``prompt``/``chosen``/``rejected`` records), with TRL's
    losses and logged metrics (:mod:`lightning_plugins.preference.losses`)."""

    method: Literal["sft", "dpo", "simpo", "orpo", "kto"] = "sft"
    """``sft``; ``dpo`` (against a reference: with ``lora``, the base model with the adapters disabled); ``simpo``
    or ``orpo`` (reference-free, on length-averaged log-probabilities); ``kto`` (unpaired examples against a
    reference: :class:`~lightning_plugins.preference.kto.KTOObjective`, on TRL's ``prompt``/``completion``/``label``
    records, ``data.format: unpaired``)."""
    beta: float = 0.1
    """The methods' temperature: DPO's KL coefficient (IPO's tau), SimPO's reward scale, ORPO's odds-ratio weight
    (TRL's ``beta``; TRL's ORPO default is 0.1, SimPO's paper uses 2.0 to 10.0)."""
    loss_type: Literal["sigmoid", "robust", "ipo"] = "sigmoid"
    """DPO's loss: ``sigmoid`` (DPO), ``robust`` (robust DPO: ``label_smoothing`` is the probability a pair's label is
    flipped) or ``ipo`` (IPO, its log-ratios averaged over the completion's tokens, as TRL)."""
    label_smoothing: float = 0.0
    """``robust`` DPO: the flip probability, in [0, 0.5); SimPO: conservative label smoothing, in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin (TRL's ``simpo_gamma``)."""
    reference: Literal["model", "precomputed"] = "model"
    """DPO's reference. ``model``: with ``lora`` the base with the adapters disabled (no copy); for a full fine-tune a
    frozen copy of ``model.path`` laid out exactly like the policy (FSDP2, TP, CP, EP shards; its parameters only, no
    gradients or optimizer state), built on meta and loaded sharded
    (:func:`~lightning_plugins.preference.reference.frozen_reference`). ``precomputed``: the reference's per-row
    log-probabilities computed in one pass over the training and held-out data before training, so that no reference
    is held or run while training (:class:`~lightning_plugins.preference.precomputed.PrecomputedReference`: at the
    run's start, each data rank for its share of the rows, then kept next to the tokenized data under a key of the
    model, data, layout and code, which a later run reads back; in your own loop,
    :func:`~lightning_plugins.preference.reference.precompute_reference_logps` and ``batch["ref_logps"]``). DPO only
    (not KTO), not under pipeline parallelism."""
    desirable_weight: float = 1.0
    """KTO: the weight of the desirable examples' losses (TRL's ``desirable_weight``)."""
    undesirable_weight: float = 1.0
    """KTO: the weight of the undesirable examples' losses (TRL's ``undesirable_weight``)."""
    sft_weight: float = 0.0
    """SimPO: weight of the chosen completions' token-mean NLL added to the loss (TRL CPO's ``cpo_alpha``, whose default
    there is 1.0; SimPO's paper uses none). ORPO always adds that NLL with weight 1."""

    def __post_init__(self) -> None:
        if self.method not in ("sft", *PAIRED, *UNPAIRED):
            raise OptionsError(f"objective.method={self.method!r} is not one of sft, {', '.join(PAIRED + UNPAIRED)}.")
        if not (self.desirable_weight > 0 and self.undesirable_weight > 0):
            raise OptionsError(
                f"objective.desirable_weight and undesirable_weight must be > 0, got {self.desirable_weight!r},"
                f" {self.undesirable_weight!r}."
            )
        if not self.beta > 0:
            raise OptionsError(f"objective.beta must be > 0, got {self.beta!r}.")
        if self.loss_type not in ("sigmoid", "robust", "ipo"):
            raise OptionsError(f"objective.loss_type={self.loss_type!r} is not one of sigmoid, robust, ipo.")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise OptionsError(f"objective.label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}.")
        if self.reference not in ("model", "precomputed"):
            raise OptionsError(f"objective.reference={self.reference!r} is not one of model, precomputed.")
        if self.sft_weight < 0:
            raise OptionsError(f"objective.sft_weight must be >= 0, got {self.sft_weight!r}.")

    @property
    def paired(self) -> bool:
        """Whether the method trains on chosen/rejected pairs."""
        return self.method in PAIRED

    @property
    def unpaired(self) -> bool:
        """Whether the method trains on unpaired examples (KTO)."""
        return self.method in UNPAIRED

    @property
    def needs_reference(self) -> bool:
        """Whether the method's loss needs a reference model."""
        return self.method in NEEDS_REFERENCE

    @property
    def reference_per_step(self) -> bool:
        """Whether each training step runs the reference's forward (``reference: model``; not when precomputed)."""
        return self.needs_reference and self.reference == "model"

    @property
    def no_grad_forwards(self) -> int:
        """Forwards of each micro-batch without backward, beside the policy's: DPO's reference (1, none when
        precomputed); KTO's 3 (the policy's of the KL rows, the reference's of the rows and of the KL rows)."""
        if not self.reference_per_step:
            return 0
        return 3 if self.unpaired else 1

    def frozen_copy(self, lora: object | None) -> bool:
        """Whether the reference is a frozen copy of the model (DPO without ``lora``), which costs its parameters."""
        return self.needs_reference and lora is None and self.reference == "model"
