"""`Trainer(strategy=...)` with a peft LoRA model inside the user's LightningModule matches one process
under TP (with and without SP/LP), FSDP2, PP, CP (both backends), TP x FSDP2 and with activation
checkpointing; the frozen base never moves and gets no gradients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _world import script_env

SCRIPT = Path(__file__).parent / "scripts" / "lora_trainer.py"
TOL = 1e-5


@pytest.mark.parametrize("devices", [2, 4])
def test_lora_under_every_strategy(devices: int, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", str(devices), "--out", str(out)],
        cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    assert len(results) == {2: 6, 4: 2}[devices]
    for name, case in results.items():
        assert case["steps"] == 4, (name, case)
        assert case["loss_diff"] <= TOL and case["weight_diff"] <= TOL, (name, case)
        assert case["base_moved"] == 0.0 and case["frozen_with_grad"] == 0, (name, case)
        assert case["adapters_moved"] > 1e-3, (name, case)  # the adapters did train
        # Only adapters are optimized (a pipeline rank holds its stages' adapters only).
        assert 0 < case["optimizer_params"] <= case["adapter_params"], (name, case)
        if not name.startswith("pp"):
            assert case["optimizer_params"] == case["adapter_params"], (name, case)
