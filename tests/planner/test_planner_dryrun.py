"""The dry run: real-size state per rank against the ZeRO/Megatron formulas, and predicted peaks against real runs.

The formulas are derived here from the config's dimensions (not from the planner's own counts): a
Llama decoder layer holds q/o (h x n_heads*d), k/v (h x n_kv*d), three MLP projections (h x i) and two
norms (h); mixed-precision AdamW keeps 16 bytes per trainable parameter under FSDP2 (fp32 weights, fp32
gradients, two fp32 moments), sharded over tensor x data ranks (ZeRO-3); a pipeline rank holds its
stages' layers (the first stages one more when the layers do not divide) plus the embedding (first)
or the final norm and head (last).
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig, LlamaConfig

from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions
from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.planner import dryrun, rank_memory
from lightning_plugins.planner.dryrun import dry_run, resident_state
from lightning_plugins.planner.workload import Workload

MIXED = MemoryOptions(param_dtype="bf16")  # fp32 master weights, bf16 compute


def _config(name: str):
    return AutoConfig.from_pretrained(f"recipes/configs/{name}")


def _layer(c) -> int:
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, h = c.num_attention_heads * d, c.num_key_value_heads * d, c.hidden_size
    return 2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h


def _lora_layer(c, r: int) -> int:
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, h, i = c.num_attention_heads * d, c.num_key_value_heads * d, c.hidden_size, c.intermediate_size
    return r * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3)  # q, o; k, v; gate, up, down


def _total(c) -> int:
    return c.num_hidden_layers * _layer(c) + 2 * c.vocab_size * c.hidden_size + c.hidden_size


def _close(measured: dict[str, int], expected: dict[str, float]) -> None:
    for key, value in expected.items():
        assert measured[key] == pytest.approx(value, rel=0.01), (key, measured[key], value)


@pytest.mark.parametrize(("name", "tp", "world"), [("Llama-3.1-8B", 1, 8), ("Llama-3.1-70B", 8, 64)])
def test_full_state_is_16_bytes_per_parameter_over_all_shards(name: str, tp: int, world: int) -> None:
    config = _config(name)
    workload = Workload(config, ParallelLayout(tp_size=tp).resolve(world), memory=MIXED, dtype="fp32")
    [(_, _, state)] = resident_state(workload)
    per_rank = _total(config) / world
    _close(state, {"parameters": 4 * per_rank, "gradients": 4 * per_rank, "optimizer": 8 * per_rank})


def test_405b_tp8_pp8_fsdp8_state_per_pipeline_rank() -> None:
    config = _config("Llama-3.1-405B")
    layout = ParallelLayout(tp_size=8, pp_size=8).resolve(512)
    workload = Workload(config, layout, ParallelOptions(pp_microbatches=8), MIXED, dtype="fp32")
    embedding = config.vocab_size * config.hidden_size
    # 126 layers over 8 stages: 16, 16, 16, 16, 16, 16, 15, 15.
    expected = {
        "first stage": 16 * _layer(config) + embedding,
        "middle stages": 16 * _layer(config),
        "last stage": 15 * _layer(config) + embedding + config.hidden_size,
    }
    states = resident_state(workload)
    assert [kind for kind, _, _ in states] == list(expected)
    for kind, _, state in states:
        per_rank = expected[kind] / 64  # tensor x data ranks of one stage
        _close(state, {"parameters": 4 * per_rank, "gradients": 4 * per_rank, "optimizer": 8 * per_rank})


@pytest.mark.parametrize("autocast,adapter_bytes", [(True, 4), (False, 2)])
def test_lora_state_trains_only_the_adapters(autocast: bool, adapter_bytes: int) -> None:
    config = _config("Llama-3.1-8B")
    lora = LoraOptions(
        r=16,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        autocast_adapter_dtype=autocast,
    )
    workload = Workload(config, ParallelLayout().resolve(8), lora=lora, dtype="bf16")
    [(_, _, state)] = resident_state(workload)
    adapters = config.num_hidden_layers * _lora_layer(config, 16)
    # peft keeps adapters in fp32 on a bf16 base (autocast_adapter_dtype, its default), so their AdamW state is fp32
    # too; with it off they are bf16 like the base.
    _close(
        state,
        {
            "parameters": (2 * _total(config) + adapter_bytes * adapters) / 8,
            "gradients": adapter_bytes * adapters / 8,
            "optimizer": 2 * adapter_bytes * adapters / 8,
        },
    )


def test_qlora_base_is_counted_at_nf4_size() -> None:
    config = _config("Llama-3.1-70B")
    workload = Workload(config, ParallelLayout().resolve(8), lora=LoraOptions(r=16, quantize="nf4"), dtype="bf16")
    [(_, _, state)] = resident_state(workload)
    # NF4 with double quantization: 4-bit codes, one int8 absmax per 64 weights, one bf16 factor per 256 blocks.
    nf4_per_param = 0.5 + 1 / 64 + 2 / (64 * 256)
    linear = config.num_hidden_layers * (_layer(config) - 2 * config.hidden_size)
    dense = _total(config) - linear
    adapters = config.num_hidden_layers * _lora_layer(config, 16)
    expected = (linear * nf4_per_param + 2 * dense + 4 * adapters) / 8  # fp32 adapters, as above
    _close(state, {"parameters": expected, "gradients": 4 * adapters / 8, "optimizer": 8 * adapters / 8})


@pytest.mark.slow  # the design check of MEASURED_LAYERS; the default suite checks the dry run against real runs
def test_extrapolation_from_fewer_layers_matches_measuring_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each interval's peak, extrapolated from 4 and 8 layers per rank, equals the peak of all of them: 24 layers
    in one process, with and without checkpointing; 40 layers in a 2-stage 1F1B pipeline (20 per rank)."""
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    config, deep = LlamaConfig(num_hidden_layers=24, **shape), LlamaConfig(num_hidden_layers=40, **shape)
    full = MemoryOptions(activation_checkpointing="full")
    cases = [
        Workload(config, ParallelLayout().resolve(2), seq_len=256, micro_batch_size=2, dtype="fp32"),
        Workload(config, ParallelLayout().resolve(2), memory=full, seq_len=256, micro_batch_size=2, dtype="fp32"),
        Workload(
            deep,
            ParallelLayout(pp_size=2).resolve(4),
            ParallelOptions(pp_microbatches=4),
            seq_len=256,
            micro_batch_size=4,
            dtype="fp32",
        ),
    ]
    for workload in cases:
        extrapolated = dry_run(workload)
        assert all(any("extrapolated" in note for note in rank.notes) for rank in extrapolated)
        monkeypatch.setattr(dryrun, "MEASURED_LAYERS", (32, 64))
        direct = dry_run(workload)
        monkeypatch.undo()
        for guess, truth in zip(extrapolated, direct):
            assert not truth.notes  # measured as it is
            assert guess.total == pytest.approx(truth.total, rel=0.01), (guess.kind, guess.peak, truth.peak)
            distance = sum(abs(guess.peak[k] - truth.peak[k]) for k in rank_memory.PEAK_CATEGORIES)
            assert distance <= 0.01 * truth.total, (guess.kind, guess.peak, truth.peak)  # the same moment


def test_dry_run_predicts_the_peak_of_real_runs() -> None:
    """Each small layout, run for real on gloo (``testing/memory_layouts.py``), and its dry run on a fake process group,
    moment by moment: both cut the step into the same intervals
    (:func:`lightning_plugins.planner.intervals.mark_intervals`).

    At each interval's peak the total is within 10% and the breakdown by category agrees, its L1 distance within 15%
    of the total (a fake process group holds a few MiB more than gloo in places: the tiny TP2 layout's layers'
    backward 1 MiB more, 35.14 against 34.15, next to a head interval of 34.66 against 34.67, so comparing the two
    steps' overall peaks could pair different moments). Parameters and optimizer state agree within 1% at the real
    peak's moment.
    """
    from lightning_plugins.testing.memory_layouts import CONFIG, LAYOUTS, SEQ_LEN, measured

    real = measured()
    config = LlamaConfig(**CONFIG)
    for name, spec in LAYOUTS.items():
        workload = Workload(
            config,
            spec.layout.resolve(spec.world_size),
            spec.options,
            spec.memory,
            spec.lora,
            dtype="fp32",
            seq_len=SEQ_LEN,
            micro_batch_size=spec.rows,
            objective=spec.objective,
        )
        for predicted in dry_run(workload):
            truths = [dict(interval) for interval in real[name][f"rank{predicted.rank}"]["intervals"]]
            for truth in truths:
                truth["other"] += truth.pop("buffers")
            assert len(predicted.intervals) == len(truths), f"{name}: {predicted.intervals} vs {truths}"
            for index, (guess, truth) in enumerate(zip(predicted.intervals, truths)):
                where = f"{name} {predicted.kind} interval {index}: predicted {guess}, measured {truth}"
                assert guess["total"] == pytest.approx(truth["total"], rel=0.10), where
                distance = sum(abs(guess[k] - truth[k]) for k in rank_memory.PEAK_CATEGORIES)
                assert distance <= 0.15 * truth["total"], where
            at_peak = max(range(len(truths)), key=lambda index: truths[index]["total"])
            assert predicted.total == pytest.approx(truths[at_peak]["total"], rel=0.10), name
            for key in ("parameters", "optimizer"):
                assert predicted.intervals[at_peak][key] == pytest.approx(truths[at_peak][key], rel=0.01), name


def test_cpu_offload_peak_is_the_gpus() -> None:
    """Under FSDP2's CPU offload the sharded state lives on the host: the GPU's peak moment is chosen without it.
    Chosen by a total that counts it (the host's gradients pile up as backward runs), the two measured copies peaked
    at different moments and Llama-3.1-70B's extrapolated peak lost the layer inputs that activation checkpointing
    keeps (and went negative in some categories)."""
    from lightning_plugins.planner import load_model_config

    config = load_model_config("Llama-3.1-70B")
    memory = MemoryOptions(activation_checkpointing="full", cpu_offload=True)
    work = Workload(config, ParallelLayout().resolve(8), memory=memory, dtype="bf16", seq_len=2048, micro_batch_size=2)
    [rank] = dry_run(work)
    assert all(nbytes >= 0 for nbytes in rank.peak.values()), rank.peak
    kept = config.num_hidden_layers * 2 * 2048 * config.hidden_size * 2  # each layer's input, bf16
    assert rank.peak["activations"] >= kept, (rank.peak, kept)
    assert rank.peak["parameters"] == rank.peak["optimizer"] == 0  # on the host
