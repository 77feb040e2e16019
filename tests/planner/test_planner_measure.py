"""The measured side of the planner's prediction test: real per-rank peak memory of small layouts on gloo.

``lightning_plugins.testing.memory_layouts`` runs every layout of its :data:`LAYOUTS` for real (one 2-rank and
one 4-rank world) under :func:`lightning_plugins.planner.measure.measure_step_memory`. These tests check that the
measurement is right where it can be derived without the engine: the shares of the one-process model each rank holds
(FSDP2's dim-0 shards with their padding, tensor-parallel splits with RMSNorm weights replicated, pipeline
stages by layer), AdamW's two moments plus a step scalar per trainable tensor, LoRA training only its
adapters, full activation checkpointing keeping fewer activations, and the tracker holding exactly that
state at the end of the backward. The measurements are written to ``measured.json`` in pytest's temp dir.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore
from tiny_models import make_batch, tiny_model

from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.planner.measure import CATEGORIES, StepMemTracker, measure_step_memory
from lightning_plugins.testing.memory_layouts import CONFIG, LAYOUTS, MemoryLayout, make_model, measured

FP32 = 4  # bytes per element: the model is fp32
ADAM_STEP = 4  # AdamW's `step` is a float32 scalar tensor per parameter (not capturable, not fused)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    results = measured()
    (tmp_path_factory.mktemp("planner") / "measured.json").write_text(json.dumps(results, indent=1))
    return results


def _each(results: dict[str, dict[str, Any]]):
    for name, spec in LAYOUTS.items():
        for rank in range(spec.world_size):
            yield name, spec, results[name][f"rank{rank}"]


@functools.cache
def _one_process(lora: LoraOptions | None) -> tuple[tuple[str, tuple[int, ...], bool], ...]:
    """(name, shape, trainable) of every parameter of the one-process model."""
    return tuple((n, tuple(p.shape), p.requires_grad) for n, p in make_model(lora).named_parameters())


def _held(name: str, pp_size: int, pp_rank: int) -> bool:
    """Whether pipeline rank ``pp_rank`` holds parameter ``name``: its layers, the embedding first, norm and head last."""
    if pp_size == 1:
        return True
    layer = re.search(r"\.layers\.(\d+)\.", name)
    if layer:
        return int(layer.group(1)) // (CONFIG["num_hidden_layers"] // pp_size) == pp_rank
    return pp_rank == (0 if "embed_tokens" in name else pp_size - 1)


def _shard_bytes(name: str, shape: tuple[int, ...], spec: MemoryLayout, coords: dict[str, int], padded: bool) -> int:
    """Bytes of one parameter on a rank: TP splits every linear and the embedding (RMSNorm weights replicated),
    then FSDP2 splits dim 0 over the data and context ranks into ``ceil(dim0 / n)`` rows, the last shards
    holding fewer (``padded``: the storage FSDP2 keeps, every shard padded to the full chunk)."""
    layout = spec.layout.resolve(spec.world_size)
    tp = 1 if name.endswith("norm.weight") else layout.tp_size
    n, fsdp_rank = layout.fsdp_size, coords["dp"] * layout.cp_size + coords["cp"]
    numel = math.prod(shape)
    if tp > 1:
        # Which dimension TP splits does not matter for the bytes as long as every split is even.
        assert shape[0] % (tp * n) == 0 and numel % (tp * n) == 0, f"{name} {shape}: pick sizes divisible by tp x fsdp"
        return numel // (tp * n) * FP32
    rest, chunk = numel // shape[0], math.ceil(shape[0] / n)
    rows = chunk if padded else max(0, min(chunk, shape[0] - fsdp_rank * chunk))
    return rows * rest * FP32


def _expected(spec: MemoryLayout, coords: dict[str, int], *, trainable: bool, padded: bool) -> tuple[int, int]:
    """(bytes, tensors) of the parameters (``trainable``: only those) this rank holds, from the one-process model."""
    pp_size = spec.layout.resolve(spec.world_size).pp_size
    held = [
        (name, shape)
        for name, shape, grad in _one_process(spec.lora)
        if _held(name, pp_size, coords["pp"]) and (grad or not trainable)
    ]
    return sum(_shard_bytes(name, shape, spec, coords, padded) for name, shape in held), len(held)


def test_every_layout_is_measured_on_every_rank(results: dict[str, dict[str, Any]]) -> None:
    for name, _, measured_rank in _each(results):
        peak = measured_rank["peak"]
        assert all(peak[c] >= 0 for c in CATEGORIES), (name, peak)
        assert sum(peak[c] for c in CATEGORIES) == peak["total"], (name, peak)
        assert peak["activations"] > 0, (name, peak)
        state = measured_rank["state"]
        assert peak["total"] >= state["parameters"] + state["gradients"] + state["optimizer"], (name, peak, state)


def test_tracker_holds_exactly_the_training_state(results: dict[str, dict[str, Any]]) -> None:
    """Right after the backward the tracker's categories hold what the tensors hold (counted apart from it)."""
    for name, _, measured_rank in _each(results):
        state, after, peak = measured_rank["state"], measured_rank["after_backward"], measured_rank["peak"]
        for category in ("parameters", "gradients", "optimizer"):
            assert after[category] == state[category], (name, category, after, state)
        assert peak["parameters"] == state["parameters"], (name, peak, state)  # FSDP2's gathered copies: temporaries
        assert peak["optimizer"] >= state["optimizer"], (name, peak, state)


def test_each_rank_holds_its_share_of_the_one_process_parameters(results: dict[str, dict[str, Any]]) -> None:
    for name, spec, measured_rank in _each(results):
        expected, _ = _expected(spec, measured_rank["coords"], trainable=False, padded=True)
        assert measured_rank["state"]["parameters"] == expected, (name, measured_rank["coords"])


def test_fsdp2_holds_half_the_parameters_up_to_dim0_padding(results: dict[str, dict[str, Any]]) -> None:
    for name in ("fsdp2", "cp2_ulysses", "lora_fsdp2"):  # FSDP2 over 2 data (or context) ranks
        spec = LAYOUTS[name]
        params = _one_process(spec.lora)
        total = sum(math.prod(shape) for _, shape, _ in params) * FP32
        padding = sum((math.ceil(s[0] / 2) * 2 - s[0]) * math.prod(s[1:]) for _, s, _ in params) * FP32
        for rank in range(spec.world_size):
            held = results[name][f"rank{rank}"]["state"]["parameters"]
            assert total / 2 <= held <= total / 2 + padding, (name, rank, held, total, padding)


def test_adamw_keeps_two_moments_and_a_step_per_trainable_tensor(results: dict[str, dict[str, Any]]) -> None:
    for name, spec, measured_rank in _each(results):
        trainable, tensors = _expected(spec, measured_rank["coords"], trainable=True, padded=False)
        assert measured_rank["state"]["optimizer"] == 2 * trainable + ADAM_STEP * tensors, name


def test_gradients_cover_the_trainable_shards(results: dict[str, dict[str, Any]]) -> None:
    for name, spec, measured_rank in _each(results):
        expected, _ = _expected(spec, measured_rank["coords"], trainable=True, padded=True)
        gradients, layout = measured_rank["state"]["gradients"], spec.layout.resolve(spec.world_size)
        if layout.tp_size > 1 and layout.fsdp_size == 1:
            # Plain TP: the vocab-sharded embedding's gradient comes back replicated (full size) on each rank.
            assert gradients >= expected, name
        else:
            assert gradients == expected, name


def test_lora_trains_only_the_adapters(results: dict[str, dict[str, Any]]) -> None:
    spec = LAYOUTS["lora_fsdp2"]
    adapters = [(n, s) for n, s, grad in _one_process(spec.lora) if grad]
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n, _ in adapters)
    for rank in range(spec.world_size):
        measured_rank = results["lora_fsdp2"][f"rank{rank}"]
        coords = measured_rank["coords"]
        padded = sum(_shard_bytes(n, s, spec, coords, padded=True) for n, s in adapters)
        unpadded = sum(_shard_bytes(n, s, spec, coords, padded=False) for n, s in adapters)
        state = measured_rank["state"]
        assert state["gradients"] == padded
        assert state["optimizer"] == 2 * unpadded + ADAM_STEP * len(adapters)
        assert measured_rank["peak"]["gradients"] <= padded
        full = results["fsdp2"][f"rank{rank}"]["state"]
        assert state["optimizer"] < full["optimizer"] / 10  # the frozen base has no optimizer state


def test_full_checkpointing_keeps_fewer_activations(results: dict[str, dict[str, Any]]) -> None:
    for rank in range(LAYOUTS["tp2_fsdp2"].world_size):
        none, full = results["tp2_fsdp2"][f"rank{rank}"]["peak"], results["tp2_fsdp2_ac_full"][f"rank{rank}"]["peak"]
        assert full["activations"] < none["activations"], (rank, none, full)
        assert full["total"] < none["total"], (rank, none, full)


def test_one_process_step_and_the_tracker_leaves_nothing_behind() -> None:
    """Without any parallelism the same function works in one process, and it restores what it patches."""
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batch(2, 16, model.config.vocab_size, seed=0)
    resize = torch.UntypedStorage.resize_
    result = measure_step_memory(model, optimizer, batch)
    assert torch.UntypedStorage.resize_ is resize
    params = [p.numel() * FP32 for p in model.parameters()]
    optimizer_bytes = 2 * sum(params) + ADAM_STEP * len(params)
    assert result["state"] == {"parameters": sum(params), "gradients": sum(params), "optimizer": optimizer_bytes}
    assert result["peak"]["parameters"] == sum(params) and result["peak"]["activations"] > 0
    with pytest.raises(ValueError, match="steps_before=0"):
        measure_step_memory(model, optimizer, batch, steps_before=0)


def test_dtensor_shape_propagation_is_not_counted() -> None:
    """DTensor derives an operation's output shape, the first time it meets it, by running it on fake tensors of the
    global shapes: no rank ever holds those, and the tracker must not count them (under the dry run's fake tensors
    they made a 2.9 GiB phantom at Qwen2.5-32B's TP4 head). The shapes here are met nowhere else, so the propagation
    runs under the tracker."""
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (8,))
        propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        with FakeTensorMode():  # as in the dry run
            weight = DTensor.from_local(torch.randn(13, 29), mesh, [Shard(0)])  # global [104, 29]
            with StepMemTracker() as tracker:
                doubled = weight.to(torch.float64)
        assert ShardingPropagator._propagate_tensor_meta_non_cached is propagate  # restored on exit
        local = doubled.to_local()
        assert doubled.shape == (104, 29) and local.shape == (13, 29)
        assert tracker.by_category("peak")["total"] == local.numel() * local.element_size()
    finally:
        dist.destroy_process_group()
