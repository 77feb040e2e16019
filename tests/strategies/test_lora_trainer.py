"""`Trainer(strategy=...)` with a peft LoRA model inside the user's LightningModule matches one process
under TP (with and without SP/LP), FSDP2, PP, CP (both backends), TP x FSDP2 and with activation
checkpointing; the frozen base never moves and gets no gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import shared_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "lora_trainer.py"
TOL = 1e-5


@pytest.mark.parametrize("devices", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_lora_under_every_strategy(
    devices: int, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = shared_script(request, tmp_path_factory, SCRIPT.name, devices)  # 4 ranks: one world with context_trainer
    assert len(results) == {2: 6, 4: 2}[devices]
    for name, case in results.items():
        assert case["steps"] == 3, (name, case)
        assert case["loss_diff"] <= TOL and case["weight_diff"] <= TOL, (name, case)
        assert case["base_moved"] == 0.0 and case["frozen_with_grad"] == 0, (name, case)
        assert case["adapters_moved"] > 1e-3, (name, case)  # the adapters did train
        # Only adapters are optimized (a pipeline rank holds its stages' adapters only).
        assert 0 < case["optimizer_params"] <= case["adapter_params"], (name, case)
        if not name.startswith("pp"):
            assert case["optimizer_params"] == case["adapter_params"], (name, case)
