"""`Trainer(strategy=ContextParallelStrategy(...))` with an unchanged LightningModule matches one process.

Lightning re-launches a script per rank, so each world is one script run that checks several cases
(see tests/scripts/context_trainer.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _launch import shared_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "context_trainer.py"
TOL = 1e-5


def test_context_parallel_trainer_matches_one_process(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # One 4-rank launch covers Ulysses cp2 x dp2 (the sampler shards over dp only), ring cp4 and
    # ring cp2 x tp2 through ParallelismStrategy, then issue 27's Gemma 2 (ring cp4) and Mistral with a window
    # (Ulysses cp2 x dp2); the rank count is the slow part on CPU.
    devices = 4
    results = shared_script(request, tmp_path_factory, SCRIPT.name, devices)  # one world with lora_trainer's 4 ranks
    assert results, "no case ran"
    for name, case in results.items():
        assert case["steps"] == 3, name
        assert case["seen_lengths"] == [16 // (4 if "cp4" in name else 2)], (name, case)  # the module got its shard
        assert case["loss_diff"] <= TOL, (name, case)
        assert case["weight_diff"] <= TOL, (name, case)
        assert case["logged_diff"] == 0.0, (name, case)  # the logged loss is the global one on every rank
