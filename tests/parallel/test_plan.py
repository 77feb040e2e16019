"""A run's ``ParallelPlan`` checks its settings once: resolved before the model exists (a door that needs its mesh
first), it checks the model's config when given it, once per config; ``parallelize``'s checks do not run them again.
No process group is needed: nothing here builds a mesh."""

from __future__ import annotations

import pytest
from _counted import counted_settings_checks
from tiny_models import CONFIGS, tiny_model

from lightning_plugins import LayoutError, ParallelLayout
from lightning_plugins.parallel import check_parallelizable
from lightning_plugins.parallel.plan import resolve


def test_a_plan_resolved_before_the_model_checks_its_config_once() -> None:
    model = tiny_model("llama")
    with counted_settings_checks() as checks:
        plan = resolve(ParallelLayout(tp_size=2), world_size=4)
        assert plan.layout.dp_shard_size == 2 and not plan.checked_config
        check_parallelizable(model, plan)  # the door's early check: the config is checked here
        check_parallelizable(model, plan)  # parallelize's own check with the same plan: not again
        plan.check_config(model.config)
    assert checks == [("check_settings", None), ("check_model_fit", model.config)]  # what the config adds, once
    assert plan.checked_config


def test_a_config_the_plan_cannot_run_is_refused_when_it_is_attached() -> None:
    plan = resolve(ParallelLayout(tp_size=2), world_size=2)
    config = CONFIGS["llama"]()
    config.num_key_value_heads = 1
    with pytest.raises(LayoutError, match="tp_size=2 does not divide num_key_value_heads=1"):
        plan.check_config(config)
    assert not plan.checked_config
