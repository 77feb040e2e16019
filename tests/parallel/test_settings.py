"""One typed object per setting, one spelling per field, each check once (``check_settings``), in every door."""

from __future__ import annotations

import pytest

from lightning_plugins import LayoutError, MemoryOptions, OptionsError, ParallelLayout, ParallelOptions
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.parallel.layout import given_sizes
from lightning_plugins.strategies import ContextParallelStrategy, ParallelismStrategy, PipelineParallelStrategy

TOO_FEW_MICROBATCHES = r"pp_schedule='1f1b' needs at least as many micro-batches as pipeline stages: pp_microbatches=1"


def test_layout_is_built_by_name_only() -> None:
    with pytest.raises(TypeError, match="positional"):
        ParallelLayout(1, 2)  # type: ignore[misc]


def test_doors_take_the_layout_whole_or_by_size_and_sizes_override_it() -> None:
    layout = ParallelLayout(tp_size=2, dp_shard_size=2)
    assert ParallelismStrategy(layout=layout).layout == layout
    assert ParallelismStrategy(tp_size=2, dp_shard_size=2).layout == layout
    assert ParallelismStrategy(layout=ParallelLayout(tp_size=4), tp_size=2, dp_shard_size=2).layout == layout
    assert PipelineParallelStrategy(layout=ParallelLayout(pp_size=4)).layout.pp_size == 4
    assert PipelineParallelStrategy().layout.pp_size == 2
    # A layout given whole gives every size; keywords alone leave the others to the launch (Accelerate) or defaults.
    assert given_sizes(layout, cp_size=2) == {
        "pp_size": 1, "dp_replicate_size": 1, "dp_shard_size": 2, "cp_size": 2, "tp_size": 2, "ep_size": 1
    }  # fmt: skip
    assert given_sizes(cp_size=2, ep_size=2) == {
        "pp_size": None, "dp_replicate_size": None, "dp_shard_size": None, "cp_size": 2, "tp_size": None, "ep_size": 2
    }  # fmt: skip
    with pytest.raises(TypeError, match="positional"):
        ParallelismStrategy(2)  # type: ignore[misc]


def test_one_spelling_per_setting_in_every_door() -> None:
    strategy = PipelineParallelStrategy(pp_size=2, pp_schedule="GPipe", pp_microbatches=4)
    assert strategy.options == ParallelOptions(pp_schedule="gpipe", pp_microbatches=4)
    assert ContextParallelStrategy(cp_size=2, cp_backend="ring").options.cp_backend == "ring"
    for old, door in (("schedule", PipelineParallelStrategy), ("microbatches", PipelineParallelStrategy),
                      ("backend", ContextParallelStrategy)):  # fmt: skip
        with pytest.raises(OptionsError, match=rf"{door.__name__} got unknown setting\(s\) \['{old}'\]"):
            door(**{old: 2})


def test_each_check_runs_once_with_one_message_in_every_door() -> None:
    """The same pipeline check refuses the same options at a strategy's construction and in the engine."""
    options = ParallelOptions(pp_microbatches=1)
    with pytest.raises(OptionsError, match=TOO_FEW_MICROBATCHES):
        check_settings(ParallelLayout(pp_size=2), options, MemoryOptions())
    with pytest.raises(OptionsError, match=TOO_FEW_MICROBATCHES):
        PipelineParallelStrategy(pp_size=2, pp_microbatches=1)
    with pytest.raises(OptionsError, match=TOO_FEW_MICROBATCHES):
        ParallelismStrategy(pp_size=2, tp_size=2, options=options)
    # What needs the world size waits for a resolved layout; what needs a model waits for its config.
    check_settings(ParallelLayout(cp_size=2), ParallelOptions(), MemoryOptions(cpu_offload=True))
    with pytest.raises(OptionsError, match="cpu_offload, param_dtype and reduce_dtype are FSDP2 options"):
        check_settings(ParallelLayout(tp_size=2).resolve(2), ParallelOptions(), MemoryOptions(cpu_offload=True))
    with pytest.raises(LayoutError, match="pp_size=4 exceeds num_hidden_layers=2"):
        check_settings(ParallelLayout(pp_size=4).resolve(4), ParallelOptions(), MemoryOptions(), _Config())


class _Config:
    model_type = "llama"
    num_attention_heads = num_key_value_heads = 4
    intermediate_size = vocab_size = 64
    num_hidden_layers = 2
