"""A pipeline step whose repeated micro-batches are replayed (:mod:`lightning_plugins.planner.replay`) measures what
the step that runs every one of them measures: every interval, byte for byte.

The replay is what keeps a 405B pipeline dry run under a minute; what it must never do is change a figure. Each case
below measures one fake rank's step twice, replayed and run whole, each in its own process, and asserts that the
replay did replay micro-batches (a test that replays nothing could not fail) and that the intervals are equal.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch.distributed.pipelining.stage
from transformers import LlamaConfig

from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions
from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.planner.dryrun import measure_step, rank_kinds
from lightning_plugins.planner.forked import forked
from lightning_plugins.planner.replay import MISMATCH, ReplayMismatch, _plan, mismatched, without_replay
from lightning_plugins.planner.workload import Workload
from lightning_plugins.preference.options import PreferenceOptions

_CONFIG = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=256,
)  # fmt: skip

#: (schedule, stages per rank, pp_reshard_per_microbatch, tensor parallel): the schedules and FSDP2 states the
#: 405B recipes run (interleaved 1F1B resharded per micro-batch; 1F1B keeping the stage gathered), and GPipe.
_CASES = [
    ("interleaved_1f1b", 2, True, 1),
    pytest.param(("interleaved_1f1b", 2, True, 2), marks=pytest.mark.slow, id="interleaved_1f1b-tp2"),
    pytest.param(("1f1b", 1, False, 1), marks=pytest.mark.slow, id="1f1b"),
    pytest.param(("gpipe", 1, True, 1), marks=pytest.mark.slow, id="gpipe"),
]


#: torch 2.15's stages allocate a receive buffer per micro-batch (``_ForwardChunkState``), which a replay would not
#: count: there nothing replays (``replay._known_stage``), and the intervals must still be equal.
_REPLAYS = not hasattr(torch.distributed.pipelining.stage, "_ForwardChunkState")


def _workload(schedule: str, stages: int, reshard: bool, tp: int) -> Workload:
    options = ParallelOptions(pp_schedule=schedule, pp_microbatches=16, pp_stages_per_rank=stages)
    memory = MemoryOptions(param_dtype="bf16", activation_checkpointing="full", pp_reshard_per_microbatch=reshard)
    layout = ParallelLayout(pp_size=2, tp_size=tp, dp_shard_size=2).resolve(4 * tp)
    return Workload(_CONFIG, layout, options, memory, dtype="fp32", seq_len=64, micro_batch_size=16)


@pytest.mark.parametrize("case", _CASES)
def test_a_replayed_step_measures_every_interval_the_whole_step_does(case: tuple) -> None:
    workload = _workload(*case)
    calls = []
    for _, rank in rank_kinds(workload)[-1:] if case == _CASES[0] else rank_kinds(workload):  # the last: the loss
        calls += [(measure_step, (workload, rank)), (partial(measure_step, replay=False), (workload, rank))]
    results = forked(calls)
    for replayed, whole in zip(results[::2], results[1::2]):
        assert (replayed["replayed"] > 0) == _REPLAYS and whole["replayed"] == 0
        assert len(replayed["intervals"]) == len(whole["intervals"]) > 8
        assert replayed["intervals"] == whole["intervals"]
        assert replayed["bounding"] == whole["bounding"]


@pytest.mark.slow
def test_a_kto_pipeline_step_is_measured_with_the_replay_on() -> None:
    """KTO under PP (LoRA, 1F1B, 16 micro-batches) runs three forward-only passes under ``no_grad`` before its training
    schedule (the policy's of the KL rows, the reference's of the rows and of the KL rows). They always run: a no-grad
    forward's window is no training forward's (before, the second pass took the first's agreed window and planned its
    replay from a forward-only schedule's stage, whose ``chunks`` is unset: a TypeError). The step measured with the
    replay on equals the whole step on both stages (seen here: none of its micro-batches replays on either stage)."""
    workload = replace(_workload("1f1b", 1, False, 1), lora=LoraOptions(r=8, alpha=16),
                       objective=PreferenceOptions("kto"))  # fmt: skip
    calls = []
    for _, rank in rank_kinds(workload):
        calls += [(measure_step, (workload, rank)), (partial(measure_step, replay=False), (workload, rank))]
    results = forked(calls)
    assert len(results) == 4
    for replayed, whole in zip(results[::2], results[1::2]):
        assert len(replayed["intervals"]) == len(whole["intervals"]) > 8
        assert replayed["intervals"] == whole["intervals"] and replayed["bounding"] == whole["bounding"]


def _interleaved_last_rank(n: int = 16) -> list[tuple[str, int]]:
    """One stage's runs on the last of 8 pipeline ranks, 2 stages each, as torch's interleaved 1F1B orders them."""
    order = [("forward", i) for i in range(9)]
    for i in range(8):
        order += [("backward", i)] + ([("forward", 9 + i)] if 9 + i < n else [])
    return order + [("backward", i) for i in range(8, n)]


def test_the_plan_replays_runs_recorded_twice_and_returns_to_where_it_began() -> None:
    timeline = _interleaved_last_rank()
    planned = _plan(timeline, 16)
    # Forwards 1-2 (warm-up), 9-10 (after a backward) and backwards 1-2, 8-10 (after a forward, after a backward)
    # are recorded; 7 and 8 run whole, their backward coming where no backward has been recorded twice yet.
    assert planned == {3, 4, 5, 6, 11, 12, 13, 14}
    assert 0 not in planned and 15 not in planned


def test_a_step_the_replay_cannot_count_is_measured_again_in_full() -> None:
    wrapped = RuntimeError("[Stage 1] failed to run forward")
    wrapped.__cause__ = ReplayMismatch("stage 1 must run from a state its replayed runs did not leave")
    assert mismatched(wrapped) and not mismatched(RuntimeError("another failure"))
    fn, args = without_replay((partial(measure_step, count=True), ("workload", 0)))
    assert fn.func is measure_step and fn.keywords == {"count": True, "replay": False} and args == ("workload", 0)
    assert MISMATCH not in {"intervals": [], "bounding": [], "replayed": 0}
