"""The strategies are registered in Lightning's registry under readable names."""

from __future__ import annotations

import lightning as L
import pytest

import lightning_plugins.strategies as strategies


@pytest.mark.parametrize("name,cls", [("tensor_parallel", strategies.TensorParallelStrategy), ("parallelism", strategies.ParallelismStrategy)])
def test_strategy_by_name(name: str, cls: type) -> None:
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is cls


@pytest.mark.parametrize(
    "cls",
    [
        strategies.ParallelismStrategy,
        strategies.TensorParallelStrategy,
        strategies.ContextParallelStrategy,
        strategies.PipelineParallelStrategy,
    ],
)
def test_lightning_cli_sees_every_layout_size(cls: type) -> None:
    """LightningCLI (jsonargparse) reads init_args from the signatures: every size, ``ep_size`` included, is there."""
    from jsonargparse import ArgumentParser

    from lightning_plugins.parallel.layout import SIZE_NAMES

    parser = ArgumentParser()
    parser.add_class_arguments(cls, "strategy")
    config = parser.parse_args([f"--strategy.{name}=2" for name in SIZE_NAMES])
    assert {name: config.strategy[name] for name in SIZE_NAMES} == dict.fromkeys(SIZE_NAMES, 2)
