"""The strategies are registered in Lightning's registry under readable names."""

from __future__ import annotations

import lightning as L
import pytest

import lightning_plugins.strategies as strategies


@pytest.mark.parametrize("name,cls", [("tensor_parallel", strategies.TensorParallelStrategy), ("parallelism", strategies.ParallelismStrategy)])
def test_strategy_by_name(name: str, cls: type) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is cls
