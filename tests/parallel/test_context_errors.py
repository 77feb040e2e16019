"""Context parallelism: batch sharding, and bad input failing early with a message naming the fix.

One process: a fake process group stands in for the world where a mesh is needed (no communication
happens before these errors).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tiny_models import CONFIGS, make_batch, tiny_model
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoModelForCausalLM

from lightning_plugins import LayoutError, OptionsError, ParallelLayout, ParallelOptions, parallelize
from lightning_plugins.parallel.context import (
    ATTENTION_IMPLEMENTATION,
    apply_context_parallel,
    context_parallel_attention,
    load_balanced_indices,
    shard_batch_for_context_parallel,
    unshard_sequence_load_balanced,
)
from lightning_plugins.parallel.context.wiring import _STATE_ATTR, _AttentionState
from lightning_plugins.strategies import ContextParallelStrategy, ParallelismStrategy


@pytest.fixture
def fake_world(request):
    """A fake process group (default 8 ranks): real code paths, no communication."""
    world_size = getattr(request, "param", 8)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    yield world_size
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# Sharding a batch
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp,seq", [(2, 13), (2, 16), (4, 21)])
def test_shards_reassemble_to_the_padded_shifted_batch(cp: int, seq: int) -> None:
    batch = make_batch(3, seq, 64, seed=0)
    shards = [shard_batch_for_context_parallel(batch, rank, cp) for rank in range(cp)]
    padded = -seq % (2 * cp)
    for rank, shard in enumerate(shards):
        assert set(shard) == {"input_ids", "labels", "shift_labels", "position_ids"}  # the mask was checked, dropped
        assert shard["position_ids"].tolist() == [load_balanced_indices(seq + padded, rank, cp).tolist()] * 3
    whole = {k: unshard_sequence_load_balanced(torch.cat([s[k] for s in shards], -1), -1, cp) for k in shards[0]}
    assert torch.equal(whole["input_ids"][:, :seq], batch["input_ids"])
    assert torch.equal(whole["labels"][:, :seq], batch["labels"])
    # Next-token targets computed on the full sequence: position t predicts labels[t + 1], across shards.
    assert torch.equal(whole["shift_labels"][:, : seq - 1], batch["labels"][:, 1:])
    assert (whole["shift_labels"][:, seq - 1 :] == -100).all() and (whole["labels"][:, seq:] == -100).all()


def test_given_shift_labels_and_plain_positions_are_kept() -> None:
    batch = make_batch(2, 8, 64, seed=0)
    shift = torch.randint(0, 64, (2, 8)).masked_fill(batch["attention_mask"] == 0, -100)
    out = shard_batch_for_context_parallel(
        {"input_ids": batch["input_ids"], "shift_labels": shift, "position_ids": torch.arange(8)[None], "meta": 1}, 1, 2
    )
    assert torch.equal(out["shift_labels"], torch.cat([shift[:, 2:4], shift[:, 4:6]], -1))
    assert out["meta"] == 1  # non-sequence entries pass through


def test_left_padding_becomes_right_padding_keeping_positions() -> None:
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
    mask = (ids > 0).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 3] = 11  # the first real token has a target: the last left pad must not predict it
    shards = [
        shard_batch_for_context_parallel({"input_ids": ids, "attention_mask": mask, "labels": labels}, r, 2)
        for r in (0, 1)
    ]
    whole = {k: unshard_sequence_load_balanced(torch.cat([s[k] for s in shards], -1), -1, 2) for k in shards[0]}
    assert whole["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert whole["position_ids"][0].tolist() == [3, 4, 5, 6, 7, 8, 9, 10]  # one process counts from the first pad
    assert whole["shift_labels"][0].tolist() == [6, 7, 8, 9, -100, -100, -100, -100]
    assert whole["input_ids"][1].tolist() == ids[1].tolist() and whole["position_ids"][1].tolist() == list(range(8))
    assert whole["shift_labels"][1].tolist() == [2, 3, 11, 5, 6, 7, 8, -100]


def test_packed_positions_are_kept() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])  # three documents; padded to 12
    shards = [
        shard_batch_for_context_parallel(
            {"input_ids": torch.ones(1, 10, dtype=torch.long), "position_ids": positions}, r, 2
        )
        for r in (0, 1)
    ]
    whole = unshard_sequence_load_balanced(torch.cat([s["position_ids"] for s in shards], -1), -1, 2)
    assert whole.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6]]


def _bad(**changes) -> dict:
    batch = make_batch(2, 8, 64, seed=0)
    batch.update(changes)
    return {k: v for k, v in batch.items() if v is not None}


@pytest.mark.parametrize(
    "batch,message",
    [
        (_bad(attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]] * 2)), "left or right padding.*holes"),
        (_bad(labels=torch.zeros(2, 8, dtype=torch.long)), "`labels` hold targets at padded positions.*-100"),
        (_bad(attention_mask=torch.ones(2, 1, 8, 8)), "2-D `attention_mask`.*4-D masks are not supported"),
        (_bad(position_ids=torch.tensor([[0, 1, 2, 3, 5, 6, 7, 8]] * 2)), "row 0 jumps from 3 to 5 at index 4.*from 0"),
        (
            _bad(position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])[:, :6]),
            r"\[batch, seq\] or \[1, seq\] = \[2, 8\]",
        ),
        (_bad(position_ids=torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6]] * 2)), "must not be negative"),
        (_bad(inputs_embeds=torch.zeros(2, 8, 4)), "pass token ids, not `inputs_embeds`"),
        (_bad(token_type_ids=torch.zeros(2, 8, dtype=torch.long)), "'token_type_ids'.*does not know how to shard"),
        (_bad(input_ids=torch.zeros(8, dtype=torch.long)), r"`input_ids` of shape \[batch, seq\]"),
        ([torch.zeros(2, 8)], "dict-like batches"),
    ],
    ids=[
        "mask-hole",
        "labels-on-pads",
        "4d-mask",
        "document-not-from-0",
        "positions-shape",
        "negative-positions",
        "inputs-embeds",
        "unknown-per-token-key",
        "1d-input-ids",
        "not-a-dict",
    ],
)
def test_batch_sharding_refuses(batch, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shard_batch_for_context_parallel(batch, 0, 2)


def test_pad_multiple_must_fit_the_layout() -> None:
    with pytest.raises(ValueError, match="multiple of 2 \\* cp_size = 4"):
        shard_batch_for_context_parallel(make_batch(1, 8, 64, seed=0), 0, 2, pad_to_multiple_of=6)


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_strategy_shards_batches_and_names_itself_in_errors(fake_world: int) -> None:
    strategy = ContextParallelStrategy(cp_size=2)
    strategy.layout = strategy.layout.resolve(2)
    strategy._device_mesh = strategy.layout.build_mesh("cpu")
    batch = make_batch(2, 13, 64, seed=0)
    out = strategy.batch_to_device(batch, torch.device("cpu"))
    assert out["input_ids"].shape == (2, 8) and out["position_ids"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    batch["attention_mask"][:, 1] = 0
    with pytest.raises(ValueError, match=r"ContextParallelStrategy \(cp_size=2\): .*holes"):
        strategy.batch_to_device(batch, torch.device("cpu"))


# ----------------------------------------------------------------------------------------------------
# Layout and model
# ----------------------------------------------------------------------------------------------------


def test_ulysses_heads_checked_before_any_collective(fake_world: int) -> None:
    model = tiny_model("llama")  # 4 heads, 2 kv heads
    with pytest.raises(
        LayoutError, match=r"4 attention heads over cp_size=8 .* cp_size in \[1, 2, 4\].*backend='ring'"
    ):
        parallelize(model, ParallelLayout(cp_size=8))
    # Tensor parallelism splits the heads first: 4 heads / tp 2 = 2 per rank cannot split over cp 4.
    with pytest.raises(LayoutError, match=r"2 attention heads \(4 heads / tp_size=2\) over cp_size=4"):
        parallelize(model, ParallelLayout(cp_size=4, tp_size=2))
    assert model.config._attn_implementation == "sdpa"
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_ring_has_no_head_constraint(fake_world: int) -> None:
    model = parallelize(tiny_model("llama"), ParallelLayout(cp_size=8), ParallelOptions(cp_backend="ring"))
    assert model.config._attn_implementation == ATTENTION_IMPLEMENTATION


def test_unknown_backend(fake_world: int) -> None:
    with pytest.raises(OptionsError, match="cp_backend='star' is not a context-parallel backend.*'ulysses', 'ring'"):
        parallelize(tiny_model("llama"), ParallelLayout(cp_size=2), ParallelOptions(cp_backend="star"))
    with pytest.raises(OptionsError, match="cp_backend='star' is not a context-parallel backend"):
        ContextParallelStrategy(cp_size=2, cp_backend="star")
    with pytest.raises(OptionsError, match="cp_backend='star' is not a context-parallel backend"):
        ParallelismStrategy(cp_size=2, cp_backend="star")


def test_ring_refuses_attention_dropout(fake_world: int) -> None:
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.1
    with pytest.raises(OptionsError, match="Ring attention has no attention dropout.*backend='ulysses'"):
        parallelize(
            AutoModelForCausalLM.from_config(config), ParallelLayout(cp_size=2), ParallelOptions(cp_backend="ring")
        )


def test_strategy_arguments() -> None:
    with pytest.raises(LayoutError, match="cp_size must be a positive integer or 'auto', got 0"):
        ContextParallelStrategy(cp_size=0)
    with pytest.raises(OptionsError, match="ContextParallelStrategy got unknown setting\\(s\\) \\['backend'\\]"):
        ContextParallelStrategy(cp_size=2, backend="ring")
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["context_parallel"]["strategy"] is ContextParallelStrategy


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_context_parallel_applies_once(fake_world: int) -> None:
    model = tiny_model("llama")
    mesh = ParallelLayout(cp_size=2).resolve(2).build_mesh("cpu")
    apply_context_parallel(model, model.model.layers, mesh["cp"], "ring")
    with pytest.raises(LayoutError, match="already context parallel"):
        apply_context_parallel(model, model.model.layers, mesh["cp"], "ring")


def test_attention_refuses_unprepared_modules_and_4d_masks() -> None:
    model = tiny_model("llama")
    attention = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 4, 8)
    with pytest.raises(RuntimeError, match="was not prepared by `apply_context_parallel`.*parallelize"):
        context_parallel_attention(attention, q, q, q, None)
    setattr(attention, _STATE_ATTR, _AttentionState(None, 2, "ring", "sdpa", model.config))
    with pytest.raises(ValueError, match="cannot apply a custom 4-D attention mask"):
        context_parallel_attention(attention, q, q, q, torch.zeros(1, 1, 4, 4))
