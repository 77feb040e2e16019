"""DPO and KTO in the user's own Accelerate loop: ``PreferenceObjective`` called on ``collate_pairs`` batches (KTO:
``KTOObjective`` on ``collate_unpaired`` ones) between ``ParallelAccelerator.prepare`` and ``backward`` (as
``docs/accelerate.md`` tells it) matches one process under FSDP2, TP=2 (sequence and loss parallel) and CP=2 (ring)
(KTO: TP=2 and CP=2): the step losses, TRL's metrics of every micro-batch and the trained adapters, over 3 clipped
steps of 2 accumulated micro-batches. One launched world of 2 ranks checks the five."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from _common import ACCUM, LR, full_weights, step_losses
from preference_trainer import (
    BATCHES,
    DPO,
    KTO,
    LOCAL_PAIRS,
    lora_model,
    max_norm_of,
    metrics_error,
    objective_of,
    pairs,
    reference_fit,
    unpaired,
)

from lightning_plugins.data.packing import collate_pairs
from lightning_plugins.data.preference import collate_unpaired
from lightning_plugins.preference import PreferenceOptions
from lightning_plugins.testing.world import run_world

TOL = 1e-9  # float64 (preference_trainer.DTYPE: why)
#: name: (ParallelAccelerator sizes and settings, data-parallel ranks, objective)
CASES: dict[str, tuple[dict[str, Any], int, PreferenceOptions]] = {
    "fsdp2": ({"dp_shard_size": 2}, 2, DPO),
    "tp2 sp+lp": ({"tp_size": 2}, 1, DPO),
    "cp2 ring": ({"cp_size": 2, "cp_backend": "ring"}, 1, DPO),
    "kto tp2 sp+lp": ({"tp_size": 2}, 1, KTO),
    "kto cp2 ring": ({"cp_size": 2, "cp_backend": "ring"}, 1, KTO),
}


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value for name, value in full_weights(model).items() if "lora_" in name}


def own_loop(
    accelerator: Any, model: torch.nn.Module, loader: Any, options: PreferenceOptions = DPO
) -> tuple[list[float], list[dict[str, float]]]:
    """The user's loop: each micro-batch's loss and TRL's metrics."""
    dpo, max_norm = objective_of(options), max_norm_of(options)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, metrics = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss, logged = dpo(model, batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        metrics.append({name: value.item() for name, value in logged.items()})
    return losses, metrics


def _cases(rank: int, world_size: int, expected: dict[str, Any]) -> None:
    from torch.utils.data import DataLoader

    from lightning_plugins.accelerate import ParallelAccelerator

    for name, (settings, dp, options) in CASES.items():
        model = lora_model()
        local, data, collate = _data(options, dp, model.config.vocab_size)
        loader = DataLoader(data, batch_size=local, collate_fn=collate)
        accelerator = ParallelAccelerator(**settings, cpu=True, gradient_accumulation_steps=ACCUM)
        losses, metrics = own_loop(accelerator, model, loader, options)
        want_losses, want_metrics, adapters = expected[name]
        assert len(losses) == len(want_metrics) == 3 * ACCUM, (name, len(losses))
        torch.testing.assert_close(torch.tensor(step_losses(losses)), torch.tensor(want_losses), rtol=0, atol=TOL)
        assert all(got.keys() == want.keys() for got, want in zip(metrics, want_metrics)), (name, metrics[0])
        worst = max(metrics_error(got, want) for got, want in zip(metrics, want_metrics))
        assert worst <= TOL, (name, worst)
        for param, value in _adapters(accelerator.unwrap_model(model)).items():
            torch.testing.assert_close(value, adapters[param], rtol=0, atol=TOL, msg=f"{name} {param}")


def _data(options: PreferenceOptions, dp: int, vocab: int) -> tuple[int, list[dict], Any]:
    """A rank's micro-batch size, the data and its collator: DPO's pairs, or KTO's examples (as many rows as DPO's
    pairs)."""
    if options.unpaired:
        local = 2 * LOCAL_PAIRS
        return local, unpaired(local * dp * BATCHES, vocab), partial(collate_unpaired, pad_token_id=0)
    return LOCAL_PAIRS, pairs(LOCAL_PAIRS * dp * BATCHES, vocab), partial(collate_pairs, pad_token_id=0)


def _expected() -> dict[str, Any]:
    """One process over the global micro-batches each world sees: rank ``r`` of ``dp`` takes the loader's batches
    ``r, r + dp, ...``, so a global micro-batch holds ``dp`` consecutive batches' pairs."""
    expected = {}
    for name, (_, dp, options) in CASES.items():
        reference = lora_model()
        start = _adapters(reference)
        local, data, collate = _data(options, dp, reference.config.vocab_size)
        size = local * dp
        batches = [collate(data[i : i + size]) for i in range(0, len(data), size)]
        losses, metrics, clipped = reference_fit(reference, batches, options)
        assert clipped, name  # every step clips: the global gradient norm matters
        adapters = _adapters(reference)
        assert max((adapters[k] - start[k]).abs().max().item() for k in start) > 1e-2, name  # they trained (0.09-0.24)
        expected[name] = (losses, metrics, adapters)
    return expected


@pytest.mark.slow  # ~70 s here: one world of 2 ranks, 5 layouts
def test_dpo_in_the_users_accelerate_loop_matches_one_process() -> None:
    run_world(_cases, 2, _expected())
