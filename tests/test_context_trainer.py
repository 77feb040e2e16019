"""`Trainer(strategy=ContextParallelStrategy(...))` with an unchanged LightningModule matches one process.

Lightning re-launches a script per rank, so each world is one script run that checks several cases
(see tests/scripts/context_trainer.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _world import script_env

SCRIPT = Path(__file__).parent / "scripts" / "context_trainer.py"
TOL = 1e-5


def test_context_parallel_trainer_matches_one_process(tmp_path: Path) -> None:
    # One 4-rank launch covers Ulysses cp2 x dp2 (the sampler shards over dp only), ring cp4 and
    # ring cp2 x tp2 through ParallelismStrategy; the rank count is the slow part on CPU.
    devices = 4
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", str(devices), "--out", str(out)],
        cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(out.read_text())
    assert results, "no case ran"
    for name, case in results.items():
        assert case["steps"] == 3, name
        assert case["seen_lengths"] == [16 // (4 if "cp4" in name else 2)], (name, case)  # the module got its shard
        assert case["loss_diff"] <= TOL, (name, case)
        assert case["weight_diff"] <= TOL, (name, case)
        assert case["logged_diff"] == 0.0, (name, case)  # the logged loss is the global one on every rank
