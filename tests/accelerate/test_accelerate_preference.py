"""DPO in the user's own Accelerate loop: ``PreferenceObjective`` called on ``collate_pairs`` batches between
``ParallelAccelerator.prepare`` and ``backward`` (as ``docs/accelerate.md`` tells it) matches one process under FSDP2,
TP=2 (sequence and loss parallel) and CP=2 (ring): the step losses, TRL's metrics of every micro-batch and the trained
adapters, over 3 clipped steps of 2 accumulated micro-batches. One launched world of 2 ranks checks the three."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from _common import ACCUM, LR, MAX_NORM, full_weights, step_losses
from lightning_plugins.testing.world import run_world
from preference_trainer import BATCHES, DPO, LOCAL_PAIRS, lora_model, pairs, reference_fit

from lightning_plugins.data.packing import collate_pairs

TOL = 1e-5
#: name: (ParallelAccelerator sizes and settings, data-parallel ranks)
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "fsdp2": ({"dp_shard_size": 2}, 2),
    "tp2 sp+lp": ({"tp_size": 2}, 1),
    "cp2 ring": ({"cp_size": 2, "cp_backend": "ring"}, 1),
}


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value for name, value in full_weights(model).items() if "lora_" in name}


def own_loop(accelerator: Any, model: torch.nn.Module, loader: Any) -> tuple[list[float], list[dict[str, float]]]:
    """The user's loop: each micro-batch's loss and TRL's metrics."""
    from lightning_plugins.preference import PreferenceObjective

    dpo = PreferenceObjective(DPO)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, metrics = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss, logged = dpo(model, batch)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        metrics.append({name: value.item() for name, value in logged.items()})
    return losses, metrics


def _relative(got: float, want: float) -> float:
    """Relative past 1: the sequence log-probabilities are sums of tens, which fp32 holds to ~4e-6."""
    return abs(got - want) / max(1.0, abs(want))


def _cases(rank: int, world_size: int, expected: dict[str, Any]) -> None:
    from torch.utils.data import DataLoader

    from lightning_plugins.accelerate import ParallelAccelerator

    for name, (settings, dp) in CASES.items():
        model = lora_model()
        data = pairs(LOCAL_PAIRS * dp * BATCHES, model.config.vocab_size)
        loader = DataLoader(data, batch_size=LOCAL_PAIRS, collate_fn=partial(collate_pairs, pad_token_id=0))
        accelerator = ParallelAccelerator(**settings, cpu=True, gradient_accumulation_steps=ACCUM)
        losses, metrics = own_loop(accelerator, model, loader)
        want_losses, want_metrics, adapters = expected[name]
        assert len(losses) == len(want_metrics) == 3 * ACCUM, (name, len(losses))
        torch.testing.assert_close(torch.tensor(step_losses(losses)), torch.tensor(want_losses), rtol=0, atol=TOL)
        assert all(got.keys() == want.keys() for got, want in zip(metrics, want_metrics)), (name, metrics[0])
        worst = max(_relative(got[key], want[key]) for got, want in zip(metrics, want_metrics) for key in want)
        assert worst <= TOL, (name, worst)
        for param, value in _adapters(accelerator.unwrap_model(model)).items():
            torch.testing.assert_close(value, adapters[param], rtol=0, atol=TOL, msg=f"{name} {param}")


def _expected() -> dict[str, Any]:
    """One process over the global micro-batches each world sees: rank ``r`` of ``dp`` takes the loader's batches
    ``r, r + dp, ...``, so a global micro-batch holds ``dp`` consecutive batches' pairs."""
    expected = {}
    for name, (_, dp) in CASES.items():
        reference = lora_model()
        start = _adapters(reference)
        data = pairs(LOCAL_PAIRS * dp * BATCHES, reference.config.vocab_size)
        size = LOCAL_PAIRS * dp
        batches = [collate_pairs(data[i : i + size], pad_token_id=0) for i in range(0, len(data), size)]
        losses, metrics, clipped = reference_fit(reference, batches)
        assert clipped, name  # every step clips: the global gradient norm matters
        adapters = _adapters(reference)
        assert max((adapters[k] - start[k]).abs().max().item() for k in start) > 100 * TOL, name  # they trained
        expected[name] = (losses, metrics, adapters)
    return expected


@pytest.mark.slow  # ~70 s here: one world of 2 ranks, 3 layouts
def test_dpo_in_the_users_accelerate_loop_matches_one_process() -> None:
    run_world(_cases, 2, _expected())
