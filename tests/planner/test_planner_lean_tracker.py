"""The planner's tracker without ``MemTracker``'s per-module statistics measures what it measured with them.

:class:`~lightning_plugins.planner.lean_tracker.LeanMemTracker` replaces ``MemTracker``'s operation hook and module
hooks by versions that skip the per-module snapshots (a dry run's cost per operation); the step's every interval,
its peak and the state it holds must come out the same, byte for byte, with activation checkpointing (whose region
the module hooks follow) and without.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import make_batch, tiny_model
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_plugins.planner.lean_tracker import LeanMemTracker
from lightning_plugins.planner.measure import measure_step_memory

_HOOKS = ("__torch_dispatch__", "_pre_fw_hook", "_post_fw_hook", "_pre_bw_hook", "_post_bw_hook")


def _measured(checkpointing: bool) -> dict[str, Any]:
    model = tiny_model("llama")
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return measure_step_memory(model, optimizer, make_batch(2, 16, model.config.vocab_size, seed=0))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ac", "full_ac"])
def test_lean_tracker_measures_what_memtracker_measures(checkpointing: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    lean = _measured(checkpointing)
    with monkeypatch.context() as patched:
        for name in _HOOKS:  # the stock MemTracker's hooks, statistics and all
            patched.setattr(LeanMemTracker, name, getattr(MemTracker, name))
        stock = _measured(checkpointing)
    assert len(lean["intervals"]) == len(stock["intervals"]) > 1
    assert lean == stock
