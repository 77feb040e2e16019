"""float8 counted by the dry run: FSDP2 gathers the decoder's linear weights in float8 (1 byte, not bf16's 2), the
resident state stays as it is (torchao keeps bf16 weights and casts them at each all-gather).

The expected saving is derived from the config: a Llama decoder layer's linears hold q/o (h x n_heads*d), k/v
(h x n_kv*d) and three MLP projections (h x i); its two norms (h) stay bf16, as do the embedding and the head.
"""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions
from lightning_plugins.planner.dryrun import dry_runs
from lightning_plugins.planner.workload import Workload

#: Four layers (measured as they are, no extrapolation), wide enough that the gathered layers dominate the
#: forward's temporaries, few tokens and a small vocabulary so that the activations and logits do not.
CONFIG = LlamaConfig(
    num_hidden_layers=4, hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=8,
    vocab_size=256,
)  # fmt: skip


def _linear_params(c: LlamaConfig) -> int:
    d = c.hidden_size // c.num_attention_heads
    q, kv, h = c.num_attention_heads * d, c.num_key_value_heads * d, c.hidden_size
    return 2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size


def _workload(tp: int, float8: bool) -> Workload:
    # compile with TP refuses activation checkpointing (torch 2.13): TP2 runs without it.
    memory = MemoryOptions(activation_checkpointing="full" if tp == 1 else "none")
    options = ParallelOptions(compile=True, float8=float8)
    return Workload(CONFIG, ParallelLayout(tp_size=tp).resolve(8), options, memory, seq_len=64, dtype="bf16")


def test_float8_halves_the_gathered_linear_weights_and_leaves_the_state() -> None:
    """FSDP8 and TP2 x FSDP4: the forward's temporaries (the layers FSDP2 holds gathered at once) shrink by one byte
    per linear weight of those layers (over TP), the backward's by at least one layer's; state, activations as bf16."""
    cases = [(tp, float8) for tp in (1, 2) for float8 in (False, True)]
    results = dict(zip(cases, dry_runs([_workload(tp, float8) for tp, float8 in cases])))
    h = CONFIG.hidden_size
    for tp in (1, 2):
        [bf16], [fp8] = results[tp, False], results[tp, True]
        assert fp8.state == bf16.state
        linear = _linear_params(CONFIG) // tp  # bytes one gathered layer's linears save (2 -> 1 per weight)
        layer_bf16 = 2 * (linear + 2 * h)
        # Intervals: forward to the head, the head and the loss (forward and backward), each layer's backward (four
        # layers: the last's first), the step.
        forward, backward = bf16.intervals[0], bf16.intervals[2]
        gathered = round(forward["temporaries"] / layer_bf16)  # layers held gathered at once in the forward
        assert gathered >= 2, forward  # the current layer and the prefetched next one at least
        saved = forward["temporaries"] - fp8.intervals[0]["temporaries"]
        assert saved == pytest.approx(gathered * linear, rel=1e-4), (tp, saved, gathered, linear)
        saved = backward["temporaries"] - fp8.intervals[2]["temporaries"]
        assert saved >= linear * (1 - 1e-4), (tp, saved, linear)
        # The forward's peak holds every activation saved for backward. The backward's peaks fall at other moments of
        # a layer's backward once the gathered weights are smaller, so their split into categories is not compared.
        assert len(fp8.intervals) == len(bf16.intervals)
        assert fp8.intervals[0]["activations"] == pytest.approx(forward["activations"], abs=64), (tp, forward)


def test_float8_lora_keeps_the_activations_of_bf16_lora() -> None:
    """LoRA r=16 on FSDP8 without activation checkpointing: the adapters stay bf16 and the frozen float8 bases save no
    input for backward, so the forward saves the activations bf16 LoRA saves (torchao's own linear kept o_proj's and
    down_proj's inputs: +5.5 GiB at Llama-3.1-8B, 4,096 tokens)."""
    from lightning_plugins.adapters.lora import LoraOptions

    layout, memory = ParallelLayout().resolve(8), MemoryOptions(activation_checkpointing="none")
    workloads = [
        Workload(CONFIG, layout, ParallelOptions(compile=True, float8=f), memory, lora=LoraOptions(r=16), seq_len=64,
                 dtype="bf16")
        for f in (False, True)
    ]  # fmt: skip
    [bf16], [fp8] = dry_runs(workloads)
    # The forward's peak holds everything saved for backward. The backward's peak falls at another moment once the
    # gathered weights are smaller (float8), so its split into categories is not compared.
    forward, forward8 = bf16.intervals[0], fp8.intervals[0]
    assert forward["activations"] > 0
    assert forward8["activations"] == pytest.approx(forward["activations"], abs=64), (forward, forward8)
