"""The planner's model statistics, hardware table and step-time model (one process, no GPU)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny_models import CONFIGS
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.planner.hardware import GIB, GPUS, Cluster, cluster_from, parse_bytes, peak_flops
from lightning_plugins.planner.model_stats import (
    PlannerError,
    _from_meta_layer,
    load_model_config,
    model_stats,
    shipped_configs,
)
from lightning_plugins.planner.calibration import CALIBRATION, VALIDATION, calibration_table, fit_efficiencies
from lightning_plugins.planner.timing import KERNELS, estimate_step_time, kernels_for

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny" / "model"


def _meta_numel(config, name: str | None = None) -> int:
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # an image-text checkpoint's language model (Qwen2.5-VL's): counted in the whole model
            whole = AutoModelForImageTextToText.from_config(load_model_config(name, multimodal=True))
            parts = [whole.model.language_model, whole.lm_head]
            return sum(p.numel() for p in {id(p): p for part in parts for p in part.parameters()}.values())
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------- model_stats


def test_every_shipped_config_is_found():
    assert {"Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B", "Qwen3-32B"} <= set(shipped_configs())


@pytest.mark.parametrize("name", [*shipped_configs(), str(TINY)])
def test_total_params_equal_the_meta_built_model(name):
    config = load_model_config(name)
    stats = model_stats(config)
    assert stats.total_params == _meta_numel(config, name)
    # The one-layer meta count (used for unregistered model types) agrees with the closed form, part by part.
    assert _from_meta_layer(config) == stats


@pytest.mark.parametrize("name", ["llama_tied", "qwen2", "qwen3", "gemma"])
def test_total_params_of_other_families(name):
    config = CONFIGS[name]()
    assert model_stats(config).total_params == _meta_numel(config)
    assert model_stats(config).tied_embeddings == bool(config.tie_word_embeddings)


def test_load_model_config_accepts_a_file_a_directory_and_a_shipped_name():
    by_name = load_model_config("Llama-3.1-8B")
    by_dir = load_model_config(ROOT / "recipes" / "configs" / "Llama-3.1-8B")
    by_file = load_model_config(ROOT / "recipes" / "configs" / "Llama-3.1-8B" / "config.json")
    assert by_name.to_dict() == by_dir.to_dict() == by_file.to_dict()
    assert by_name.num_hidden_layers == 32


def test_load_model_config_names_the_spec_and_the_fix():
    with pytest.raises(PlannerError, match="not found") as err:
        load_model_config("no-such-org/no-such-model")
    message = str(err.value)
    assert "'no-such-org/no-such-model'" in message
    assert "Llama-3.1-8B" in message and "config.json" in message


@pytest.mark.parametrize(
    ("config_name", "targets", "r"), [("Llama-3.1-8B", None, 16), ("Qwen3-32B", ("q_proj", "v_proj", "down_proj"), 8)]
)
def test_lora_params_per_layer_match_peft(config_name, targets, r):
    config = load_model_config(config_name)
    small = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 2, "layer_types": None})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(small)
    peft_model = apply_lora(model, LoraOptions(r=r, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert model_stats(config).lora_params_per_layer(targets, r) * 2 == trainable


def test_lora_params_hand_count():
    # Llama-3.1-8B, r=16, default targets: r x (in + out) for q, k, v, o (4096->4096, 4096->1024 twice, 4096->4096)
    # and gate, up, down (4096 <-> 14336).
    expected = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert model_stats(load_model_config("Llama-3.1-8B")).lora_params_per_layer(None, 16) == expected == 1_310_720
    with pytest.raises(PlannerError, match="w_in"):
        model_stats(load_model_config("Llama-3.1-8B")).lora_params_per_layer(("w_in",), 16)


def test_flops_per_token_by_hand():
    """Llama-3.1-8B at 8192 tokens, derived from the architecture (not from the code):

    per layer, matmul weights: q 4096x4096 + k 4096x1024 + v 4096x1024 + o 4096x4096 + gate/up/down 3 x 4096x14336
      = 2 x 16,777,216 + 2 x 4,194,304 + 3 x 58,720,256 = 218,103,808
    N = 32 x 218,103,808 + lm_head 128,256 x 4096 = 6,979,321,856 + 525,336,576 = 7,504,658,432
    attention forward per token = 4 x layers x heads x head_dim x seq = 4 x 32 x 32 x 128 x 8192
    training = 3 x forward: 6N + 12 x 32 x 4096 x 8192 = 45,027,950,592 + 12,884,901,888 = 57,912,852,480
    LoRA/QLoRA (frozen base, no weight gradients): 4N + the same attention = 30,018,633,728 + 12,884,901,888
    """
    stats = model_stats(load_model_config("Llama-3.1-8B"))
    assert stats.matmul_params == 7_504_658_432
    assert stats.flops_per_token(8192) == 57_912_852_480
    assert stats.flops_per_token(8192, trainable="lora") == 30_018_633_728 + 12_884_901_888
    # torchtitan's own count: 6 x (params - embedding) + 12 x l x h x q x t (it keeps the norms: 0.004% more).
    torchtitan = 6 * (stats.total_params - stats.embedding_params) + 12 * 32 * 32 * 128 * 8192
    assert stats.flops_per_token(8192) == pytest.approx(torchtitan, rel=1e-4)
    with pytest.raises(PlannerError, match="trainable"):
        stats.flops_per_token(8192, trainable="half")


# ---------------------------------------------------------------------------------------------- hardware


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * GIB),
        ("80GB", 80 * 10**9),
        ("80G", 80 * GIB),
        ("80 gib", 80 * GIB),
        ("24", 24 * GIB),
        (80, 80 * GIB),
        (79.5, int(79.5 * GIB)),
        (85_899_345_920, 85_899_345_920),
        ("1.5TiB", int(1.5 * 2**40)),
        ("512MiB", 512 * 2**20),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["eighty", "80 GiBs", "-80GB", "0", True, None, "80XB"])
def test_parse_bytes_errors_name_the_input_and_the_fix(text):
    with pytest.raises(PlannerError) as err:
        parse_bytes(text)
    assert repr(text) in str(err.value)
    assert "80GiB" in str(err.value)


def test_peak_flops_reads_torch_device_names():
    """MFU's peak is the planner's table, found by the name ``torch.cuda.get_device_name()`` gives."""
    assert peak_flops("NVIDIA H100 80GB HBM3") == GPUS["H100"].peak_flops
    assert peak_flops("NVIDIA L40S") == GPUS["L40S"].peak_flops != GPUS["L40"].peak_flops
    assert peak_flops("NVIDIA A10G") == 125e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Tesla T4") is None


def test_cluster_from():
    cluster = cluster_from("h100", gpus=64, gpu_memory="80GiB")
    assert cluster.gpu is GPUS["H100"] and cluster.nodes == 8 and cluster.memory == 80 * GIB
    assert cluster_from("A100-40GB").memory == 40 * GIB
    assert cluster_from("H200", gpus=4).nodes == 1
    assert {"H100", "H200", "A100", "A100-40GB", "MI300X", "L40S", "RTX4090"} <= set(GPUS)
    with pytest.raises(PlannerError, match="'H900'") as err:
        cluster_from("H900")
    assert "H100" in str(err.value) and "MI300X" in str(err.value)
    with pytest.raises(PlannerError, match="gpus=12 .*multiple of 8"):
        cluster_from("H100", gpus=12)
    with pytest.raises(PlannerError, match="nvlink_speed"):
        cluster_from("H100", nvlink_speed=1)
    with pytest.raises(PlannerError, match="mfu"):
        cluster_from("H100", mfu=1.5)


# ---------------------------------------------------------------------------------------------- step time


def _step(model="Llama-3.1-8B", gpus=8, layout=None, options=None, memory=None, cluster=None, **kwargs):
    layout = (layout or ParallelLayout()).resolve(gpus)
    cluster = cluster or cluster_from("H100", gpus=gpus)
    kwargs = {"seq_len": 4096, "micro_batch_size": 1, **kwargs}
    kwargs.setdefault("global_batch_size", layout.dp_size * kwargs["micro_batch_size"])
    return estimate_step_time(
        load_model_config(model), layout, options or ParallelOptions(), memory or MemoryOptions(), cluster, **kwargs
    )


@pytest.mark.parametrize("run", CALIBRATION, ids=lambda run: run["name"])
def test_calibration_run_is_reproduced_within_25_percent(run):
    (row,) = calibration_table((run,))
    assert 0.75 <= row["ratio"] <= 1.25, row


def test_the_issue_anchors_are_calibrated():
    required = [row["name"] for row in calibration_table() if row["required"]]
    assert len(required) == 4
    for fragment in (
        "8B FSDP8, 8 H100",
        "70B FSDP32 x TP8",
        "405B FSDP8 x TP8 x PP8 interleaved",
        "TP8 x PP16 x DP128",
    ):
        assert any(fragment in name for name in required), fragment


@pytest.mark.parametrize("run", VALIDATION, ids=lambda run: run["name"])
def test_runs_outside_the_fit_are_reproduced_within_25_percent(run):
    (row,) = calibration_table((run,))
    assert 0.75 <= row["ratio"] <= 1.25, row


def test_kernel_efficiencies_are_the_fit_of_the_calibration():
    """The constants in KERNELS are what the calibration runs imply (one per class, geometric mean)."""
    fitted = fit_efficiencies()
    assert set(fitted) == set(KERNELS)
    for name, efficiency in fitted.items():
        assert KERNELS[name].efficiency == pytest.approx(efficiency, rel=0.01), name


def test_fsdp_communication_by_hand():
    # 8B, FSDP over the 8 GPUs of one node: per step two all-gathers (forward, and backward after resharding)
    # and one reduce-scatter of all parameters in bf16, each moving 7/8 of them per GPU over 360 GB/s NVLink.
    step = _step(seq_len=4096)
    params = 8_030_261_248
    assert step.comm_s["fsdp"] == pytest.approx(7 / 8 * (2 * params * 2 + params * 2) / 360e9, rel=1e-9)
    assert any("NVLink 360 GB/s" in line for line in step.assumptions)
    # Across two nodes the same group runs over the NICs (40 GB/s per GPU), and over 16 ranks.
    wide = _step(gpus=16)
    assert wide.comm_s["fsdp"] == pytest.approx(15 / 16 * 6 * params / 40e9, rel=1e-9)
    assert any("inter-node 40 GB/s" in line for line in wide.assumptions)


def test_pipeline_stages_resharded_per_microbatch_reduce_each_microbatch():
    # PP2 x FSDP4, 8 micro-batches. FSDP2 traffic per step is gathers x G + reductions x R (G: a stage's gathered
    # parameters, R: its gradients). Resharded after forward, a stage gathers for each micro-batch's forward and
    # backward (16 G) but keeps its gradients unreduced until the last backward (1 R); never resharded, it gathers
    # once (1 G + 1 R); `pp_reshard_per_microbatch` also reduce-scatters every micro-batch's gradients (16 G + 8 R).
    layout, options = ParallelLayout(pp_size=2), ParallelOptions(pp_microbatches=8)

    def fsdp(**memory):
        step = _step("Llama-3.1-70B", layout=layout, options=options, micro_batch_size=8, memory=MemoryOptions(**memory))
        return step.comm_s["fsdp"]

    resharded, kept = fsdp(), fsdp(reshard_after_forward=False)
    gradients = (16 * kept - resharded) / 15  # R, from 16 G + R and G + R
    assert gradients > 0
    assert fsdp(pp_reshard_per_microbatch=True) == pytest.approx(resharded + 7 * gradients, rel=1e-9)


def test_tiled_mlp_adds_one_mlp_forward_by_hand():
    # 8B on one node, FSDP8, 1 x 4096 tokens a rank: the tiled MLP computes each tile again in backward, one more
    # forward of the MLP's three 4096 x 14336 matmuls per layer (2 FLOPs a weight and token), at the dense kernels'
    # rate, whether or not the layers are checkpointed.
    rate = GPUS["H100"].peak_flops * KERNELS[kernels_for(ParallelOptions())].efficiency
    extra = 4096 * 32 * 2 * 3 * 4096 * 14336 / rate
    for checkpointing in ("none", "full"):
        plain = _step(memory=MemoryOptions(activation_checkpointing=checkpointing))
        tiled = _step(memory=MemoryOptions(activation_checkpointing=checkpointing, mlp_chunk_tokens=1024))
        assert tiled.recompute_s - plain.recompute_s == pytest.approx(extra, rel=1e-9), checkpointing


def test_tensor_parallel_communication_by_hand():
    # 70B, TP8 on one node, 1 x 4096 tokens: per layer forward 2 all-gathers + 2 reduce-scatters of the
    # activations (4096 x 8192 x 2 bytes), each moving 7/8 of them; backward the same; plus the embedding output
    # and lm_head input (forward and backward): 80 x 8 + 4 collectives at 360 GB/s.
    step = _step("Llama-3.1-70B", layout=ParallelLayout(tp_size=8))
    act = 4096 * 8192 * 2
    assert step.comm_s["tp"] == pytest.approx((80 * 8 + 4) * 7 / 8 * act / 360e9, rel=1e-9)
    assert step.exposed_s["tp"] == step.comm_s["tp"]


def test_more_microbatches_shrink_the_bubble():
    layout = ParallelLayout(pp_size=8)

    def bubble(schedule, m, **extra):
        options = ParallelOptions(pp_schedule=schedule, pp_microbatches=m, **extra)
        return _step("Llama-3.1-70B", layout=layout, options=options, micro_batch_size=m).bubble

    one_f_one_b = [bubble("1f1b", m) for m in (8, 16, 32, 64)]
    assert one_f_one_b == sorted(one_f_one_b, reverse=True)
    assert one_f_one_b[0] == pytest.approx(7 / 15, rel=0.02)  # (p - 1) / (m + p - 1)
    assert bubble("interleaved_1f1b", 8) < one_f_one_b[0]
    assert bubble("zbv_zero_bubble", 16) == 0


def test_checkpointing_offload_and_methods_cost_what_they_should():
    full_ac = _step(memory=MemoryOptions(activation_checkpointing="full")).step_s
    selective = _step(memory=MemoryOptions(activation_checkpointing="selective")).step_s
    every_2 = _step(memory=MemoryOptions(activation_checkpointing="selective", every_n_layers=2)).step_s
    none = _step().step_s
    assert none < selective < every_2 < full_ac
    assert _step(memory=MemoryOptions(cpu_offload=True)).step_s > none
    lora = _step(method="lora", lora=LoraOptions()).step_s
    qlora = _step(method="qlora", lora=LoraOptions(quantize="nf4")).step_s
    assert lora < none and lora < qlora


def test_a_bigger_cluster_gives_more_tokens_per_second():
    totals = []
    for gpus in (8, 16, 64, 256):
        step = _step("Llama-3.1-70B", gpus=gpus, layout=ParallelLayout(tp_size=8), micro_batch_size=2)
        totals.append(step.tokens_per_s_per_gpu * gpus)
    assert totals == sorted(totals)


def test_hsdp_and_context_parallel_are_counted():
    hsdp = _step(gpus=64, layout=ParallelLayout(dp_replicate_size=8))
    assert hsdp.comm_s["dp_replicate"] > 0 and hsdp.comm_s["fsdp"] > 0
    for backend in ("ring", "ulysses"):
        cp = _step(layout=ParallelLayout(cp_size=4), options=ParallelOptions(cp_backend=backend), seq_len=32768)
        assert cp.comm_s["cp"] > 0
    assert json.loads(json.dumps(hsdp.as_dict()))["step_s"] == hsdp.step_s


def test_mfu_is_model_flops_over_peak():
    step = _step(seq_len=8192)
    flops = model_stats(load_model_config("Llama-3.1-8B")).flops_per_token(8192)
    assert step.mfu == pytest.approx(step.tokens_per_s_per_gpu * flops / 989.4e12)
    assert math.isclose(replace(step).step_s, step.step_s)
    override = _step(seq_len=8192, cluster=Cluster(GPUS["H100"], gpus=8, mfu=0.5))
    assert override.efficiency == 0.5 and override.step_s < step.step_s


def test_step_time_errors_name_the_fix():
    config, cluster = load_model_config("Llama-3.1-8B"), cluster_from("H100", gpus=8)
    options, memory = ParallelOptions(), MemoryOptions()
    common = {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 8}
    with pytest.raises(PlannerError, match=r"layout.resolve\(8\)"):
        estimate_step_time(config, ParallelLayout(), options, memory, cluster, **common)
    with pytest.raises(PlannerError, match="16 ranks .* 8 GPUs"):
        estimate_step_time(config, ParallelLayout().resolve(16), options, memory, cluster, **common)
    layout = ParallelLayout().resolve(8)
    with pytest.raises(PlannerError, match="method='dora'"):
        estimate_step_time(config, layout, options, memory, cluster, **common, method="dora")
    with pytest.raises(PlannerError, match="method='lora'"):
        estimate_step_time(config, layout, options, memory, cluster, **common, lora=LoraOptions())
    with pytest.raises(PlannerError, match="global_batch_size >= 16"):
        estimate_step_time(config, layout, options, memory, cluster, **{**common, "micro_batch_size": 2})
    with pytest.raises(PlannerError, match="kernels='tpu'"):
        estimate_step_time(config, layout, options, memory, cluster, **common, kernels="tpu")
    with pytest.raises(PlannerError, match="tp_size=16 .*num_key_value_heads"):
        estimate_step_time(
            config, ParallelLayout(tp_size=16).resolve(16), options, memory, cluster_from(gpus=16), **common
        )
    pp = ParallelLayout(pp_size=4).resolve(8)
    with pytest.raises(PlannerError, match="multiple of 4"):
        estimate_step_time(config, pp, options, memory, cluster, **{**common, "micro_batch_size": 2})


def test_windowed_attention_counts_the_band():
    """gpt-oss-120b alternates 128-token windows with full attention (36 layers, 64 heads of 64): at 8192 tokens
    the 18 windowed layers attend 128 keys per query, the 18 full ones 8192, so attention costs
    4 x 64 x 64 x (18 x 128 + 18 x 8192) forward per token; at 100 tokens both kinds attend all 100."""
    stats = model_stats(load_model_config("gpt-oss-120b"))
    assert stats.attention_windows == (128, 0) * 18
    assert stats.attention_flops_per_token(8192) == 4 * 64 * 64 * (18 * 128 + 18 * 8192)
    assert stats.attention_flops_per_token(100) == 4 * 64 * 64 * 36 * 100
    # A config without layer_types windows every layer when it sets sliding_window (Mistral-7B-v0.1's 4096).
    from transformers import MistralConfig

    mistral = model_stats(MistralConfig(num_hidden_layers=2, sliding_window=4096))
    assert mistral.attention_windows == (4096, 4096)
    assert model_stats(load_model_config("Mistral-7B-v0.3")).attention_windows == ()


def test_compile_float8_and_async_tp_options_pick_the_faster_calibrated_rates():
    """``ParallelOptions.compile``/``float8``/``async_tp`` reach the step-time model without naming a kernels class."""
    assert [kernels_for(ParallelOptions(**o)) for o in ({}, {"compile": True}, {"compile": True, "float8": True})] == [
        "bf16",
        "compile",
        "compile_float8",
    ]
    layout = ParallelLayout(dp_shard_size=8)
    rates = [
        _step(layout=layout, options=ParallelOptions(**o), seq_len=4096).tokens_per_s_per_gpu
        for o in ({}, {"compile": True}, {"compile": True, "float8": True})
    ]
    assert rates[0] < rates[1] < rates[2]
    # The published compile run (6,667 tokens/s/GPU) is the fit of its class; eager bf16 is 5,762.
    assert rates[1] / rates[0] == pytest.approx(KERNELS["compile"].efficiency / KERNELS["bf16"].efficiency, rel=0.05)
    tp = ParallelLayout(dp_shard_size=4, tp_size=2)
    eager_tp, async_tp = (
        _step(layout=tp, options=ParallelOptions(compile=True, async_tp=a), seq_len=4096) for a in (False, True)
    )
    assert async_tp.exposed_s["tp"] < eager_tp.exposed_s["tp"]
    assert any("async TP" in line for line in async_tp.assumptions)


def test_float8_tp_gathers_bf16_activations_in_this_engine_float8_only_in_torchtitans_runs():
    """This engine's TP plans all-gather bf16 activations under float8 (the cast follows the gather): the TP
    traffic is bf16's. torchtitan's calibrating runs gather float8 (torchao's float8 TP styles): half the forward's
    sequence all-gathers, so less TP traffic; FSDP2's float8 weight gathers count in both."""
    tp = ParallelLayout(dp_shard_size=4, tp_size=2)
    bf16, engine, titan = (
        _step(layout=tp, options=ParallelOptions(compile=True, float8=f), seq_len=4096, float8_tp=t)
        for f, t in ((False, False), (True, False), (True, True))
    )
    assert engine.comm_s["tp"] == bf16.comm_s["tp"]
    assert titan.comm_s["tp"] < engine.comm_s["tp"]
    assert engine.comm_s["fsdp"] == titan.comm_s["fsdp"] < bf16.comm_s["fsdp"]


def test_attention_kernel_follows_the_cp_backend():
    """Each layer's attention is charged on the kernel its CP backend runs it on (planner/attention_kernels.py): the
    flash kernel without CP, under Ulysses for plain layers and for ring blocks (a window's band only); eager attention
    (the whole square) under Ulysses for layers with a window, soft-capping or sinks; pure-torch fp32 tiles for ring
    attention with soft-capping."""
    from transformers import Gemma2Config

    from lightning_plugins.planner.attention_kernels import (
        EAGER,
        FLASH,
        KERNEL_SPEED,
        RING_TILES,
        attention_seconds_per_token,
        layer_kernels,
    )

    plain = {backend: _step(layout=ParallelLayout(cp_size=4), options=ParallelOptions(cp_backend=backend),
                            seq_len=32768) for backend in ("ring", "ulysses")}  # fmt: skip
    assert plain["ring"].compute_s == pytest.approx(plain["ulysses"].compute_s, rel=1e-12)
    for backend, step in plain.items():
        assert any(line.startswith(f"attention ({backend} CP): 32 layer(s) on flash") for line in step.assumptions)

    gpt_oss = model_stats(load_model_config("gpt-oss-120b"))  # windows of 128 on every second layer, sinks
    assert gpt_oss.attention_variants == ("sinks",)
    per_key, seq, rate = 4 * 64 * 64, 8192, 1e15
    ring = attention_seconds_per_token(gpt_oss, seq, "ring", 4, rate)
    assert ring == pytest.approx(per_key * 18 * (128 + seq) / rate, rel=1e-12)
    assert attention_seconds_per_token(gpt_oss, seq, "ring", 1, rate) == pytest.approx(ring, rel=1e-12)
    ulysses = attention_seconds_per_token(gpt_oss, seq, "ulysses", 4, rate)
    assert set(layer_kernels(gpt_oss, "ulysses", 4)) == {(EAGER, 0)}
    assert ulysses == pytest.approx(per_key * 36 * seq / (rate * KERNEL_SPEED[EAGER]), rel=1e-12)

    gemma2 = model_stats(Gemma2Config(num_hidden_layers=4, sliding_window=1024))  # soft-capping, every 2nd windowed
    assert gemma2.attention_variants == ("softcap",)
    assert layer_kernels(gemma2, "ring", 2) == ((RING_TILES, 1024), (RING_TILES, 0)) * 2
    assert layer_kernels(gemma2, "ring", 1) == ((FLASH, 1024), (FLASH, 0)) * 2
    gemma_ring = attention_seconds_per_token(gemma2, seq, "ring", 2, rate)
    assert gemma_ring == pytest.approx(
        attention_seconds_per_token(gemma2, seq, "ring", 1, rate) / KERNEL_SPEED[RING_TILES], rel=1e-12
    )
