"""Saving from the main process alone, as countless training scripts do, through the Accelerate door:

    state = accelerator.get_state_dict(model)          # every rank
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out, state_dict=state)

Handed the full state dict, ``save_pretrained`` writes it with no collective (it used to wait for the other ranks
until the collective timed out), under TP, FSDP2, PP and CP; the directory loads in plain transformers with the
trained weights. Called from one rank without a state dict, it fails within seconds naming the fix; afterwards a
save by every rank still works.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning_plugins.testing.world import run_world
from _accelerate_loop import ACCUM, build, prepared, run_loop
from torch.distributed.tensor import DTensor

CASES = {
    "tp2": {"tp_size": 2},
    "fsdp2": {"dp_shard_size": 2},
    "pp2": {"pp_size": 2, "pp_microbatches": 2},
    "cp2": {"cp_size": 2, "cp_backend": "ring"},
}


def _trained_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, on rank 0 (each rank holds its pipeline stages' ones)."""
    mine = {}
    for name, param in model.named_parameters():
        mine[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: weight for part in every for name, weight in part.items()}


def _cases(rank: int, world_size: int, root: str) -> None:
    from accelerate.utils import InitProcessGroupKwargs
    from transformers import AutoModelForCausalLM

    import lightning_plugins.parallel.save_pretrained as saving
    from lightning_plugins.accelerate import ParallelAccelerator

    # A collective waited on by one rank fails after a minute, not torch's default half hour.
    bounded = [InitProcessGroupKwargs(timeout=timedelta(seconds=60))]
    for name, sizes in CASES.items():
        accelerator = ParallelAccelerator(**sizes, cpu=True, gradient_accumulation_steps=ACCUM, kwargs_handlers=bounded)
        model, optimizer, loader, scheduler = prepared(accelerator, build({}), shuffle=False)
        run_loop(accelerator, model, optimizer, loader, scheduler)
        trained = _trained_weights(accelerator.unwrap_model(model))
        out = Path(root, name)
        state = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            accelerator.unwrap_model(model).save_pretrained(out, state_dict=state)
        accelerator.wait_for_everyone()
        if rank == 0:
            loaded = dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())
            assert set(loaded) == set(trained), (name, sorted(set(loaded) ^ set(trained)))
            for key, weight in trained.items():
                torch.testing.assert_close(loaded[key].detach(), weight, rtol=0, atol=0, msg=f"{name} {key}")
            assert any(not torch.equal(w, p) for (_, w), p in zip(sorted(trained.items()), _initial())), name

    # Without a state dict, from the main process alone: the collective save fails within seconds, naming the fix.
    saving.ARRIVAL_TIMEOUT_S = 2.0
    unwrapped = accelerator.unwrap_model(model)
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"every rank must call it .* only 1 of 2 ranks did .*state_dict=state"):
            unwrapped.save_pretrained(Path(root, "alone"))
        assert time.monotonic() - start < 10
    accelerator.wait_for_everyone()
    assert not Path(root, "alone", "model.safetensors").exists()
    # Called by every rank afterwards, it saves.
    unwrapped.save_pretrained(Path(root, "every rank"), is_main_process=accelerator.is_main_process)
    if rank == 0:
        assert Path(root, "every rank", "model.safetensors").is_file()


def _initial() -> list[torch.Tensor]:
    return [p.detach() for _, p in sorted(build({}).named_parameters())]


def test_main_process_saves_the_state_dict_it_was_handed(tmp_path: Path) -> None:
    run_world(_cases, 2, str(tmp_path))
