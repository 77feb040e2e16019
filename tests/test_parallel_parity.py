"""Parity of `parallelize` with one process: per-step losses and final weights, fp32, gloo.

Each launched world checks several layouts and families (starting ranks costs seconds).
"""

from __future__ import annotations

import copy

import pytest
import torch
from _world import run_world
from tiny_models import make_batch, tiny_model
from torch.distributed.tensor import DTensor

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.parallel import clip_grad_norm_, mesh_of

STEPS, ACCUM, BATCH, SEQ, MAX_NORM, LR = 5, 2, 4, 16, 0.5, 1.0
TOL = 1e-5
# SGD, not Adam: Adam's update is invariant to the gradient's scale, so it would hide a wrong loss
# normalisation; with SGD every gradient error shows in the weights. The pre-clip gradient norm is
# compared too, which catches any scale error directly.


def _local_rows(layout: ParallelLayout, rank: int) -> slice:
    """The batch rows a data-parallel rank sees (tensor-parallel peers see the same rows)."""
    dp_rank = rank // layout.tp_size
    rows = BATCH // layout.dp_size
    return slice(dp_rank * rows, (dp_rank + 1) * rows)


def _train(model: torch.nn.Module, rows: slice, clip) -> list[float]:
    """Train STEPS steps; return the per-step losses followed by the per-step gradient norms."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            batch = make_batch(BATCH, SEQ, model.config.vocab_size, seed=100 * step + micro)
            loss = model(**{k: v[rows] for k, v in batch.items()}).loss / ACCUM
            loss.backward()
            step_loss += loss.item()
        norm = clip(model.parameters(), MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        norms.append(norm.item())
    return losses + norms


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check_layouts(rank: int, world_size: int, families: list[str], layouts: list[tuple[dict, dict]]) -> None:
    for family in families:
        reference = tiny_model(family)
        ref_losses = _train(copy.deepcopy(reference), slice(None), torch.nn.utils.clip_grad_norm_)
        ref_model = copy.deepcopy(reference)
        _train(ref_model, slice(None), torch.nn.utils.clip_grad_norm_)
        expected = dict(ref_model.named_parameters())
        for sizes, options in layouts:
            layout = ParallelLayout(**sizes).resolve(world_size)
            model = parallelize(copy.deepcopy(reference), layout, **options)
            assert mesh_of(model) is not None
            losses = _train(model, _local_rows(layout, rank), clip_grad_norm_)
            where = f"{family} {sizes} {options}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=TOL, rtol=0, msg=lambda m: f"{where}: losses, grad norms: {m}")
            for name, param in model.named_parameters():
                torch.testing.assert_close(
                    _full(param.detach()), expected[name].detach(), atol=TOL, rtol=0, msg=lambda m: f"{where} {name}: {m}"
                )


TWO_RANK_LAYOUTS = [
    ({"tp_size": 2}, {}),
    ({"tp_size": 2}, {"sequence_parallel": False, "loss_parallel": False}),
    ({"tp_size": 2}, {"sequence_parallel": False, "activation_checkpointing": "full"}),
    ({"dp_shard_size": 2}, {}),
]
FOUR_RANK_LAYOUTS = [
    ({"dp_replicate_size": 2, "dp_shard_size": 2}, {}),
    ({"tp_size": 2, "dp_shard_size": 2}, {"activation_checkpointing": "selective"}),
]


@pytest.mark.parametrize("world_size,layouts", [(2, TWO_RANK_LAYOUTS), (4, FOUR_RANK_LAYOUTS)], ids=["2ranks", "4ranks"])
def test_parallelize_matches_one_process(world_size: int, layouts: list) -> None:
    run_world(_check_layouts, world_size, ["llama", "qwen2"], layouts)
