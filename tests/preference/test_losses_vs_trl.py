"""The preference losses and metrics against TRL's own code, on the same log-probabilities.

TRL 1.16 computes its losses inside its trainers' methods, not in free functions, so each is called unbound on a
minimal stand-in for the trainer: ``DPOTrainer._compute_loss`` (reference log-probabilities precomputed, a stand-in
model returning its fused head's per-token outputs), ``CPOTrainer.cpo_loss`` (SimPO), ``ORPOTrainer.odds_ratio_loss``
and ``KTOTrainer._compute_loss``. Our side is :class:`PreferenceObjective.from_logps` on the same numbers.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lightning_plugins.preference import PreferenceObjective, PreferenceOptions, SequenceLogps
from lightning_plugins.preference.losses import kto_losses

# Third-party noise of importing TRL (torchao's optional kernels, TRL's experimental namespace).
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]
trl = pytest.importorskip("trl")

PAIRS, SEQ = 6, 9


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * PAIRS
    completion = torch.zeros(rows, SEQ, dtype=torch.long)
    for row in range(rows):
        completion[row, 2 + row % 3 : SEQ - row % 2] = 1  # prompts and completions of different lengths
    shift = completion[:, 1:]
    per_token = -torch.rand(rows, SEQ - 1, generator=gen, dtype=torch.float64) * 3 * shift
    mean_logits = torch.randn(rows, SEQ - 1, generator=gen, dtype=torch.float64)
    ref = per_token.sum(1) + torch.randn(rows, generator=gen, dtype=torch.float64)
    policy = SequenceLogps(per_token.sum(1), shift.sum(1).double(), (mean_logits * shift).sum(1))
    reference = SequenceLogps(ref, shift.sum(1).double(), torch.zeros(rows, dtype=torch.float64))
    return completion, per_token, mean_logits, policy, reference


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                           unwrap_model=lambda m: m)  # fmt: skip


def _trl_dpo(loss_type: str, beta: float, smoothing: float):
    from trl.trainer.dpo_trainer import DPOTrainer

    completion, per_token, mean_logits, _, reference = _data()
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=mean_logits,
                              is_top1=torch.zeros_like(per_token, dtype=torch.bool))  # fmt: skip
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=smoothing, use_weighting=False, _total_train_tokens=0, _tp_size=1,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )  # fmt: skip
    ref_chosen, ref_rejected = reference.logps.chunk(2)
    inputs = {"input_ids": torch.zeros_like(completion), "attention_mask": torch.ones_like(completion),
              "completion_mask": completion, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = DPOTrainer._compute_loss(stub, lambda **kwargs: outputs, inputs, False)
    return loss, {key: values[-1] for key, values in stub._metrics["train"].items()}


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("robust", 0.1), ("ipo", 0.0)])
def test_dpo_matches_trl(loss_type: str, smoothing: float) -> None:
    want_loss, want = _trl_dpo(loss_type, 0.2, smoothing)
    _, _, _, policy, reference = _data()
    options = PreferenceOptions(method="dpo", beta=0.2, loss_type=loss_type, label_smoothing=smoothing)
    loss, metrics = PreferenceObjective(options).from_logps(policy, reference)
    assert abs(loss.item() - want_loss.item()) < 1e-12
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected")  # fmt: skip
    assert 0 < want["rewards/accuracies"] < 1  # both outcomes occur
    for name in names:
        tol = 1e-7 if name == "rewards/accuracies" else 1e-12  # TRL takes that mean in fp32 (`.float()`)
        assert abs(metrics[name].item() - want[name]) < tol, (name, metrics[name].item(), want[name])


def _means():
    _, _, _, policy, _ = _data()
    return (policy.logps / policy.tokens).chunk(2)


@pytest.mark.parametrize("smoothing,sft_weight", [(0.0, 0.0), (0.1, 1.0)])
def test_simpo_matches_trl_cpo(smoothing: float, sft_weight: float) -> None:
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    chosen, rejected = _means()
    stub = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=smoothing,
                           accelerator=_accelerator())  # fmt: skip
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(stub, chosen, rejected)
    _, _, _, policy, _ = _data()
    chosen_sum, chosen_tokens = policy.logps.chunk(2)[0].sum(), policy.tokens.chunk(2)[0].sum()
    want = losses.mean() + sft_weight * (-chosen_sum / chosen_tokens)  # TRL's nll: cross entropy over chosen tokens
    options = PreferenceOptions(method="simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=smoothing, sft_weight=sft_weight)
    loss, metrics = PreferenceObjective(options).from_logps(policy)
    assert abs(loss.item() - want.item()) < 1e-12
    assert abs(metrics["rewards/chosen"].item() - chosen_rewards.mean().item()) < 1e-12
    assert abs(metrics["rewards/margins"].item() - (chosen_rewards - rejected_rewards).mean().item()) < 1e-12


def test_orpo_matches_trl() -> None:
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    chosen, rejected = _means()
    stub = SimpleNamespace(beta=0.3, accelerator=_accelerator())
    losses, chosen_rewards, _, ratio, log_odds = ORPOTrainer.odds_ratio_loss(stub, chosen, rejected)
    _, _, _, policy, _ = _data()
    nll = -policy.logps.chunk(2)[0].sum() / policy.tokens.chunk(2)[0].sum()
    loss, metrics = PreferenceObjective(PreferenceOptions(method="orpo", beta=0.3)).from_logps(policy)
    assert abs(loss.item() - (nll - losses.mean()).item()) < 1e-12
    assert abs(metrics["log_odds_ratio"].item() - ratio.item()) < 1e-12
    assert abs(metrics["log_odds_chosen"].item() - log_odds.item()) < 1e-12
    assert abs(metrics["nll_loss"].item() - nll.item()) < 1e-12
    assert abs(metrics["rewards/chosen"].item() - chosen_rewards.mean().item()) < 1e-12


def test_kto_matches_trl() -> None:
    from trl.trainer.kto_trainer import KTOTrainer

    completion, per_token, mean_logits, policy, reference = _data()
    label = torch.tensor([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1])
    kl_logps, ref_kl_logps = policy.logps.flip(0) * 0.9, policy.logps.flip(0)
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=mean_logits)
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_accelerator(), aux_loss_enabled=False,
        precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=0.1, desirable_weight=1.3,
        undesirable_weight=0.7, _total_train_tokens=0, _tp_size=1, _metrics=defaultdict(lambda: defaultdict(list)),
        _compute_kl_logps=lambda model, batch: kl_logps,
    )  # fmt: skip
    batch = {"input_ids": torch.zeros_like(completion), "attention_mask": torch.ones_like(completion),
             "completion_mask": completion, "label": label, "ref_logps": reference.logps, "ref_KL_logps": ref_kl_logps}
    want = KTOTrainer._compute_loss(stub, lambda **kwargs: outputs, batch, False)
    good = label.bool()
    kl = (kl_logps - ref_kl_logps).mean().clamp(min=0)
    got = kto_losses(policy.logps[good], policy.logps[~good], reference.logps[good], reference.logps[~good], kl, 0.1,
                     1.3, 0.7)  # fmt: skip
    assert kl > 0
    assert abs(got.losses.mean().item() - want.item()) < 1e-12
    assert abs(got.chosen_rewards.mean().item() - stub._metrics["train"]["rewards/chosen"][-1]) < 1e-12
