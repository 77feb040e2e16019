"""Pipeline stages of decoders that mix linear and softmax attention (Qwen3.5 dense and MoE, Qwen3-Next) match one
process: per-step losses, pre-clip grad norms, eval losses and final weights (fp32, gloo; the harness of
``test_pipeline_parity``: SGD with momentum, accumulation, clipping, ``-100`` labels), with the rows' padding at the
front (:func:`left_padded_batch`): at the end it would never reach a valid token through a causal recurrence, and a
stage that gave its linear-attention layers no mask would pass.

Each stage gives each layer what its type needs, as the decoders' own forward does: a full-attention layer its causal
mask and rotary embedding, a Gated DeltaNet layer the 2-D padding mask (it zeroes padded positions before its
recurrence). The tiny ``*_4l`` models follow Qwen3.5's pattern (three linear-attention layers, then a full one), so
two stages hold ``[lin, lin]`` and ``[lin, full]`` and interleaved stages hold one layer each, three of them without
any softmax attention.

One launched world of 4 ranks in the default suite, two steps per layout (PP2 x TP2 with SP and loss parallel, PP2 x
FSDP2 x EP2 with the interleaved schedule, PP2 x FSDP2); the wider matrix (every schedule under PP=2, PP=4, each family
under each composition, PP x CP ring and Ulysses,
activation checkpointing), STEPS (3) steps each, is slow.
"""

from __future__ import annotations

import pytest
import test_pipeline_parity
import torch
from tiny_models import make_batch, tiny_model

from lightning_plugins.data.packing import prepare_model_for_packing
from lightning_plugins.testing.world import run_world

#: One world, the default suite: each family once, each composition once, both schedule kinds.
FOUR_RANKS = [
    ("qwen3_5_4l", {"pp_size": 2, "tp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
    (
        "qwen3_5_moe_4l",
        {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2},
        {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2},
    ),
    ("qwen3_next_4l", {"pp_size": 2, "dp_shard_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
]

SCHEDULES = test_pipeline_parity.SCHEDULES_PP2
#: PP=2 alone: every schedule on the dense model, both kinds on the MoE ones (the 3-layer tiny Qwen3.5 too: an
#: uneven split).
TWO_RANKS = [
    *[("qwen3_5_4l", {"pp_size": 2}, {"pp_schedule": name, "pp_microbatches": 4}) for name in SCHEDULES],
    ("qwen3_5", {"pp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
    *[
        (family, {"pp_size": 2}, {"pp_schedule": name, "pp_microbatches": 2})
        for family in ("qwen3_5_moe_4l", "qwen3_next_4l")
        for name in ("1f1b", "interleaved_1f1b")
    ],
    ("qwen3_5_4l", {"pp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 4, "activation_checkpointing": "full"}),
]
#: The rest of the four-rank matrix.
FOUR_RANKS_MORE = [
    ("qwen3_5_4l", {"pp_size": 2, "tp_size": 2}, {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2}),
    (
        "qwen3_5_4l",
        {"pp_size": 2, "tp_size": 2},
        {"pp_schedule": "1f1b", "pp_microbatches": 2, "sequence_parallel": False, "loss_parallel": False},
    ),
    ("qwen3_5_moe_4l", {"pp_size": 2, "tp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
    ("qwen3_next_4l", {"pp_size": 2, "tp_size": 2}, {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2}),
    ("qwen3_next_4l", {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
    (
        "qwen3_5_moe_4l",
        {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2},
        {"pp_schedule": "zbv_zero_bubble", "pp_microbatches": 2},
    ),
    ("qwen3_5_4l", {"pp_size": 2, "dp_shard_size": 2}, {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2}),
    ("qwen3_5_4l", {"pp_size": 4}, {"pp_schedule": "1f1b", "pp_microbatches": 4}),
    # PP x CP: the stages' linear-attention layers pass their state along the cp ranks (parallel/context/linear.py)
    ("qwen3_5_4l", {"pp_size": 2, "cp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2, "cp_backend": "ring"}),
    ("qwen3_5_4l", {"pp_size": 2, "cp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2, "cp_backend": "ulysses"}),
]

#: Packed rows (documents restarting the linear attention's state and conv): in the default world PP2 x TP2; slow, the
#: schedules, PP alone and PP x CP (the stages' linear attention context parallel, ring and Ulysses).
PACKED_FOUR_RANKS = (("qwen3_5_4l", {"pp_size": 2, "tp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),)
PACKED_TWO_RANKS = (
    ("qwen3_5_4l", {"pp_size": 2}, {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2}),
    ("qwen3_next_4l", {"pp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
)
PACKED_FOUR_RANKS_MORE = (
    *[
        ("qwen3_5_4l", {"pp_size": 2, "cp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2, "cp_backend": b})
        for b in ("ring", "ulysses")
    ],
    ("qwen3_5_moe_4l", {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
)


def left_padded_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """``make_batch``'s rows with their padding moved to the front.

    With right padding a causal recurrence never carries a padded position into a valid one, so a linear-attention
    layer given no padding mask would still match; at the front, every valid token's state depends on it.
    """
    rows = make_batch(batch, seq, vocab, seed)
    pads = (rows["attention_mask"] == 0).sum(dim=1)
    return {key: torch.stack([value[row].roll(int(pads[row])) for row in range(batch)]) for key, value in rows.items()}


def packed_batch(batch: int, seq: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """``make_batch``'s tokens as packed rows: documents of random lengths one after another (``position_ids``
    restarting at 0, each document's first label ``-100``), no padding."""
    rows = make_batch(batch, seq, vocab, seed)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.empty(batch, seq, dtype=torch.long)
    labels = rows["input_ids"].clone()
    for row in range(batch):
        cuts = sorted(torch.randperm(seq - 1, generator=gen)[: 1 + row].add(1).tolist())
        for lo, hi in zip([0, *cuts], [*cuts, seq]):
            positions[row, lo:hi] = torch.arange(hi - lo)
            labels[row, lo] = -100
    return {"input_ids": rows["input_ids"], "labels": labels, "position_ids": positions}


def _prepared_tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    model = tiny_model(family, seed)
    prepare_model_for_packing(model)  # the linear attention restarts at each document, as the recipes do
    return model


def _check_left_padded(rank: int, world_size: int, cases: list, steps: int, packed_cases: tuple = ()) -> None:
    test_pipeline_parity.make_batch = left_padded_batch  # this rank's process only: one process and the stages alike
    test_pipeline_parity._check_cases(rank, world_size, cases, steps)
    if packed_cases:  # packed rows: one process (each document on its own, test_linear_attention_packed.py) and stages
        test_pipeline_parity.make_batch, test_pipeline_parity.tiny_model = packed_batch, _prepared_tiny_model
        test_pipeline_parity._check_cases(rank, world_size, list(packed_cases), steps)


def test_linear_attention_stages_match_one_process() -> None:
    # Two steps: the default suite's budget (the slow matrix runs test_pipeline_parity.STEPS, 3).
    run_world(_check_left_padded, 4, FOUR_RANKS, 2, PACKED_FOUR_RANKS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,cases,packed",
    [(2, TWO_RANKS, PACKED_TWO_RANKS), (4, FOUR_RANKS_MORE, PACKED_FOUR_RANKS_MORE)],
    ids=["2ranks", "4ranks"],
)
def test_linear_attention_stages_wider_matrix(world_size: int, cases: list, packed: tuple) -> None:
    run_world(_check_left_padded, world_size, cases, test_pipeline_parity.STEPS, packed)
