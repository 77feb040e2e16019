"""The planner (issue 10), measured: its predictions next to real runs, other estimators and published figures.

Sections (default: all), each printed as markdown tables:

* ``--small``: the small layouts of ``lightning_plugins/testing/memory_layouts.py`` run for real on gloo
  (``measure_all``: torch's ``MemTracker`` on a real step), each rank kind's peak next to the dry run's prediction for
  the same workload (``dry_run(Workload(...))``, built as ``tests/planner/test_planner_dryrun.py`` builds it), by
  category.
* ``--real-size``: Llama-3.1-8B (FSDP8), 70B (TP8 x FSDP8, 64 GPUs) and 405B (TP8 x PP8 x FSDP8, 512 GPUs,
  interleaved 1F1B, 16 micro-batches; and 1F1B with 8) at seq 8192, fp32 master weights + bf16 compute
  (``MemoryOptions(param_dtype="bf16")``), full activation checkpointing: memory per GPU by category per rank kind
  and the wall time of each dry run (the 405B interleaved one is asserted under ``--max-405b-seconds``); next to
  DeepSpeed's ZeRO-3 estimator (``estimate_zero3_model_states_mem_needs_all_cold``, offload none) and
  ``accelerate estimate-memory``'s math (``calculate_maximum_sizes`` + ``estimate_training_usage`` on a meta model
  built from our shipped config, as its ``create_empty_model`` builds one from the Hub), and what each leaves out.
* ``--published``: the dry run on the settings of published fine-tuning memory figures (torchtune's README table,
  settings from its recipe configs; LLaMA-Factory's per-method table), with the settings it cannot match named.
* ``--calibration``: the planner's ``calibration_table`` (``planner.calibration``): published vs predicted tokens/s/GPU, for the fitted runs and the held-out ``VALIDATION`` runs.

Exits non-zero when the 405B interleaved dry run takes longer than ``--max-405b-seconds`` (after printing all).

Usage::

    python benchmarks/planner.py [--small] [--real-size] [--published] [--calibration]
                                 [--max-405b-seconds 60] [--output results.md] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions
from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.planner.dryrun import dry_run
from lightning_plugins.planner.rank_memory import PEAK_CATEGORIES, RankMemory
from lightning_plugins.planner.workload import Workload
from lightning_plugins.testing.bench import Timed, add_report_arguments, command, machine, write_json, write_report

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "configs"
GIB, MIB = 2**30, 2**20
#: Short column names of the peak categories.
SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optim",
    "activations": "act",
    "temporaries": "temp",
    "other": "other",
}

#: The real-size setting: fp32 master weights, bf16 compute (FSDP2 mixed precision), full activation checkpointing.
MIXED_FULL_AC = MemoryOptions(param_dtype="bf16", activation_checkpointing="full")
#: torchtune's Llama-3.1 LoRA targets (``lora_attn_modules: [q_proj, v_proj, output_proj]`` + ``apply_lora_to_mlp``).
TORCHTUNE_LORA_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TORCHTUNE_README = "https://github.com/pytorch/torchtune/blob/bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1/README.md"
TORCHTUNE_CONFIGS = (
    "https://github.com/pytorch/torchtune/tree/bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1/recipes/configs/llama3_1"
)
LLAMA_FACTORY_README = (
    "https://github.com/hiyouga/LLaMA-Factory/blob/ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30/README.md"
    "#hardware-requirement"
)


# ----------------------------------------------------------------------------------------------------------- helpers


def _config(name: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(CONFIGS / name)


def _table(header: list[str], rows: list[list[Any]], align: str | None = None) -> list[str]:
    """A markdown table; ``align`` gives ``l``/``r`` per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _timed_dry_run(workload: Workload) -> tuple[list[RankMemory], float]:
    start = time.perf_counter()
    ranks = dry_run(workload)
    return ranks, time.perf_counter() - start


def _worst(ranks: list[RankMemory]) -> RankMemory:
    return max(ranks, key=lambda rank: rank.total)


def _rank_rows(label: str, ranks: list[RankMemory], seconds: float | None = None) -> list[list[Any]]:
    """One row per rank kind: layers, GiB by category, total (and the dry run's seconds on the first row)."""
    rows = []
    for index, rank in enumerate(ranks):
        row = [label if index == 0 else "", f"{rank.kind} (rank {rank.rank})", rank.layers]
        row += [_gib(rank.peak[name]) for name in PEAK_CATEGORIES] + [f"**{_gib(rank.total)}**"]
        if seconds is not None:
            row.append(f"{seconds:.1f}" if index == 0 else "")
        rows.append(row)
    return rows


def _notes(ranks: list[RankMemory]) -> list[str]:
    """The dry run's own notes (what it modelled), once per distinct note."""
    seen: list[str] = []
    for rank in ranks:
        for note in rank.notes:
            if note not in seen:
                seen.append(note)
    return seen


@dataclass
class Section:
    """A section's markdown lines and its data for ``--json``."""

    lines: list[str]
    data: Any


# ------------------------------------------------------------------------------------------------------------ small


def small_section() -> Section:
    """The small layouts of ``testing/memory_layouts.py``: measured on gloo vs the dry run, by rank kind, category."""
    from transformers import LlamaConfig

    from lightning_plugins.testing.memory_layouts import CONFIG, LAYOUTS, SEQ_LEN, measure_all

    start = time.perf_counter()
    real = measure_all()
    measured_s = time.perf_counter() - start
    config = LlamaConfig(**CONFIG)
    header = ["layout", "ranks", "rank kind", "predicted MiB", "measured MiB", "ratio"]
    header += [f"{SHORT[name]} p / m" for name in PEAK_CATEGORIES]
    rows, data, worst_ratio = [], [], 1.0
    start = time.perf_counter()
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
        )
        for predicted in dry_run(workload):
            truth = dict(real[name][f"rank{predicted.rank}"]["peak"])
            truth["other"] += truth.pop("buffers")
            ratio = predicted.total / truth["total"]
            worst_ratio = ratio if abs(ratio - 1) > abs(worst_ratio - 1) else worst_ratio
            row = [
                name,
                spec.world_size,
                f"{predicted.kind} (rank {predicted.rank})",
                f"{predicted.total / MIB:.1f}",
                f"{truth['total'] / MIB:.1f}",
                f"{ratio:.3f}",
            ]
            row += [f"{predicted.peak[key] / MIB:.1f} / {truth[key] / MIB:.1f}" for key in PEAK_CATEGORIES]
            rows.append(row)
            data.append(
                {
                    "layout": name,
                    "kind": predicted.kind,
                    "rank": predicted.rank,
                    "predicted": predicted.peak,
                    "measured": truth,
                    "ratio": ratio,
                }
            )
    dry_s = time.perf_counter() - start
    lines = [
        "### Small layouts: predicted vs measured peak per rank",
        "",
        (
            f"Model: `lightning_plugins/testing/memory_layouts.py` (Llama h={CONFIG['hidden_size']}, "
            f"{CONFIG['num_hidden_layers']} layers, {CONFIG['num_attention_heads']} heads / "
            f"{CONFIG['num_key_value_heads']} kv heads, vocab {CONFIG['vocab_size']}; fp32, seq {SEQ_LEN}, AdamW). "
            "Measured: `measure_all()` (real gloo worlds, "
            f"`MemTracker` on the step after a warm-up step; {measured_s:.0f} s). Predicted: `dry_run` of the same "
            f"workload on a fake process group ({dry_s:.0f} s for all). Categories at the moment of the peak, "
            "predicted / measured, MiB; `other` includes buffers (rotary table), the batch and pipeline receive "
            "buffers."
        ),
        "",
        *_table(header, rows, "lrl" + "r" * (len(header) - 3)),
        "",
        f"Largest deviation of the total: ratio {worst_ratio:.3f}.",
    ]
    return Section(lines, {"measured_s": measured_s, "dry_run_s": dry_s, "rows": data})


# -------------------------------------------------------------------------------------------------------- real size


def real_size_workloads() -> list[tuple[str, str, Workload]]:
    """(model and short layout name, layout description, workload) of the real-size section."""
    c8, c70, c405 = _config("Llama-3.1-8B"), _config("Llama-3.1-70B"), _config("Llama-3.1-405B")
    common = {"memory": MIXED_FULL_AC, "dtype": "fp32", "seq_len": 8192}
    pp405 = ParallelLayout(tp_size=8, pp_size=8).resolve(512)
    interleaved = ParallelOptions(pp_schedule="interleaved_1f1b", pp_microbatches=16)
    return [
        ("Llama-3.1-8B FSDP8", "8 GPUs, micro-batch 1", Workload(c8, ParallelLayout().resolve(8), **common)),
        (
            "Llama-3.1-70B TP8 x FSDP8",
            "64 GPUs, sequence + loss parallel, micro-batch 1",
            Workload(c70, ParallelLayout(tp_size=8).resolve(64), **common),
        ),
        (
            "Llama-3.1-405B TP8 x PP8 x FSDP8 interleaved 1F1B",
            "512 GPUs, 2 stages per rank, 16 micro-batches of 1 row",
            Workload(c405, pp405, interleaved, micro_batch_size=16, **common),
        ),
        (
            "Llama-3.1-405B TP8 x PP8 x FSDP8 1F1B",
            "512 GPUs, 8 micro-batches of 2 rows",
            Workload(
                c405, pp405, ParallelOptions(pp_schedule="1f1b", pp_microbatches=8), micro_batch_size=16, **common
            ),
        ),
    ]


def _meta_model(config: Any, auto_class: str) -> torch.nn.Module:
    """``config``'s model on the meta device in fp32 (``AutoModel`` is what ``accelerate estimate-memory`` builds)."""
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights():
        return getattr(transformers, auto_class).from_config(config, dtype=torch.float32)


def deepspeed_params(config: Any) -> tuple[int, int]:
    """``(total_params, largest_layer_params)`` as DeepSpeed's ``model_to_params`` counts them on the training model.

    Its own function deduplicates by ``data_ptr()``, which is 0 for every meta tensor; shared parameters are
    deduplicated here by identity instead (Llama-3.1 ties none).
    """
    model = _meta_model(config, "AutoModelForCausalLM")
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())
    return total, largest


def deepspeed_zero3_per_gpu(total_params: int, largest_layer_params: int, gpus: int) -> float:
    """DeepSpeed's ZeRO-3 estimate per GPU (bytes) for offload_param=none, offload_optimizer=none.

    Calls ``estimate_zero3_model_states_mem_needs_all_cold`` and reads its printed table (which says "GB" and
    divides by 2**30); checked against the byte count of ``estimate_zero3_model_states_mem_needs``.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime.zero.stage3 import (
            estimate_zero3_model_states_mem_needs,
            estimate_zero3_model_states_mem_needs_all_cold,
        )

        captured.seek(0)
        captured.truncate()
        per_node = min(8, gpus)
        estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, per_node, gpus // per_node)
    match = re.search(
        r"\|\s*([0-9.]+)GB \| offload_param=none, offload_optimizer=none, zero_init=1", captured.getvalue()
    )
    if match is None:
        raise RuntimeError(f"DeepSpeed's estimator printed no offload-none row:\n{captured.getvalue()}")
    printed = float(match.group(1)) * GIB
    _, exact, _ = estimate_zero3_model_states_mem_needs(
        total_params, largest_layer_params, per_node, gpus // per_node, cpu_offload=False, cpu_offload_params=False
    )
    if abs(printed - exact) > 0.006 * GIB:
        raise RuntimeError(f"DeepSpeed's printed {printed / GIB:.2f} GiB is not its computed {exact / GIB:.2f} GiB")
    return printed


def accelerate_estimate(config: Any) -> dict[str, float]:
    """``accelerate estimate-memory``'s "Training using Adam" for float32 and float16, and its model size, in bytes.

    Its math on our shipped config: ``create_empty_model`` builds ``AutoModel`` (no LM head) in fp32 under
    ``init_empty_weights`` from a Hub config; the same is built here from the local config, then
    ``calculate_maximum_sizes`` and ``estimate_training_usage`` run as ``gather_data``/``estimate_command`` do
    (the table shows the max of model/gradients/optimizer/step for each dtype).
    """
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total_size, largest = calculate_maximum_sizes(_meta_model(config, "AutoModel"))
    return {
        "model_fp32": float(total_size),
        "largest_layer_fp32": float(largest[0]),
        "train_float32": float(max(estimate_training_usage(total_size, "float32").values())),
        "train_float16": float(max(estimate_training_usage(total_size, "float16").values())),
    }


def real_size_section(max_405b_seconds: float) -> tuple[Section, bool]:
    """Real-size dry runs (memory per rank kind, wall time), and the anchors' estimators next to them."""
    header = ["model", "rank kind", "layers", *[f"{SHORT[n]} GiB" for n in PEAK_CATEGORIES], "total GiB", "dry run s"]
    rows, data, notes = [], [], []
    first: dict[str, tuple[str, Workload, list[RankMemory]]] = {}  # per model: its first (main) layout
    timed_405b = None
    for model, layout, workload in real_size_workloads():
        ranks, seconds = _timed_dry_run(workload)
        rows += _rank_rows(f"{model} ({layout})", ranks, seconds)
        notes += [f"{model}: {note}" for note in _notes(ranks)]
        per_layer = {rank.kind: rank.activations_per_layer for rank in ranks if rank.activations_per_layer}
        if per_layer:
            notes.append(
                f"{model}: `activations_per_layer` reported: "
                + ", ".join(f"{kind} {value / MIB:.1f} MiB" for kind, value in per_layer.items())
            )
        data.append({"model": model, "layout": layout, "seconds": seconds, "ranks": [r.as_dict() for r in ranks]})
        first.setdefault(model.split()[0], (model, workload, ranks))
        if model.startswith("Llama-3.1-405B") and timed_405b is None:
            timed_405b = seconds
    passed = timed_405b is not None and timed_405b <= max_405b_seconds

    compare_header = [
        "model",
        "GPUs",
        "planner peak GiB/GPU (worst rank kind)",
        "planner model states GiB/GPU (counted)",
        "DeepSpeed ZeRO-3 GiB/GPU (offload none)",
        "accelerate estimate-memory: fp32 / float16 training GiB (whole model)",
    ]
    compare_rows = []
    for model, workload, ranks in first.values():
        worst = _worst(ranks)
        states = max(sum(rank.state.values()) for rank in ranks)
        total, largest = deepspeed_params(workload.config)
        ds = deepspeed_zero3_per_gpu(total, largest, workload.world_size)
        acc = accelerate_estimate(workload.config)
        compare_rows.append(
            [
                model,
                workload.world_size,
                f"{worst.total / GIB:.2f} ({worst.kind})",
                _gib(states),
                _gib(ds),
                f"{_gib(acc['train_float32'])} / {_gib(acc['train_float16'])}",
            ]
        )
        data.append(
            {
                "model": model,
                "gpus": workload.world_size,
                "planner_peak": worst.total,
                "planner_states": states,
                "deepspeed_zero3_per_gpu": ds,
                "deepspeed_params": [total, largest],
                "accelerate": acc,
            }
        )
    left_out = [
        [
            "planner dry run (this project)",
            (
                "per rank kind: parameters, gradients, AdamW state counted from the engine's own shards (real dtypes), "
                "activations and temporaries (logits, FSDP2 all-gathers, pipeline micro-batches in flight) measured "
                "under "
                "FakeTensorMode at the moment of the step's peak; TP/SP, PP schedule, CP, FSDP2/HSDP, AC, "
                "LoRA/QLoRA, offload"
            ),
            (
                "the CUDA context, NCCL buffers and allocator fragmentation (`plan()` keeps a 10% margin for them); "
                "fused/"
                "compiled kernels and chunked losses other frameworks use; NF4 and CPU offload are modelled, not "
                "measured"
            ),
        ],
        [
            "DeepSpeed `estimate_zero3_model_states_mem_needs_all_cold`",
            "model states only: 18 B x params / GPUs + 4 B x largest layer (its 1.5 buffer factor is for CPU memory)",
            (
                "activations and logits, TP and PP (every GPU is a ZeRO-3 data rank), LoRA/QLoRA (all parameters "
                "trainable), micro-batch and sequence length, temporaries other than one gathered layer"
            ),
        ],
        [
            "`accelerate estimate-memory` (its math on our config)",
            (
                'whole model on one device: fp32 "Training using Adam" = 16 B/param; float16 row = the max (not the '
                "sum) "
                "of model 4 B, gradients 6 B, optimizer 8 B per param = 8 B/param"
            ),
            (
                "any sharding (DP, TP, PP), activations and logits, LoRA/QLoRA, offload; counts `AutoModel` (no LM "
                "head: "
                "0.5B / 1.1B / 2.1B params fewer for 8B / 70B / 405B); needs the Hub (here fed our shipped config)"
            ),
        ],
    ]
    verdict = "PASSED" if passed else "FAILED"
    lines = [
        "### Real size: memory per GPU and dry-run time",
        "",
        (
            'Settings: seq 8192, fp32 master weights + bf16 compute (`MemoryOptions(param_dtype="bf16")`, `dtype='
            "\"fp32\"`), full activation checkpointing (chosen: what torchtitan's 70B/405B configs and torchtune's "
            "recipes use; every layer keeps only its input), AdamW, SDPA. GiB at the moment of the step's peak; the "
            "dry "
            "run's wall time is `time.perf_counter()` around `dry_run` (rank kinds dry-run in forked processes, 2 at "
            "once)."
        ),
        "",
        *_table(header, rows, "ll" + "r" * (len(header) - 2)),
        "",
        *[f"* {note}" for note in notes],
        "",
        f"405B interleaved 1F1B dry run: {timed_405b:.1f} s against the threshold of {max_405b_seconds:.0f} s: "
        f"**{verdict}**."
        if timed_405b is not None
        else "405B not run.",
        "",
        "### Real size: next to DeepSpeed's and Accelerate's estimators",
        "",
        (
            "Same models and GPU counts. DeepSpeed: ZeRO-3 over all GPUs (8 per node), per-GPU number of its printed "
            "row `offload_param=none, offload_optimizer=none`. Accelerate: its math on our shipped config (it needs "
            "the "
            "Hub): `calculate_maximum_sizes(AutoModel on meta, fp32)` and `estimate_training_usage`, one device, no "
            "sharding. Planner model states: parameters + gradients + AdamW state the worst rank kind holds."
        ),
        "",
        *_table(compare_header, compare_rows),
        "",
        *_table(["estimator", "counts", "leaves out"], left_out, "lll"),
    ]
    return Section(lines, data), passed


# -------------------------------------------------------------------------------------------------------- published


@dataclass
class PublishedCase:
    """A published memory figure and the dry run of its settings.

    Attributes:
        key: A short name other rows refer to.
        figure: What was published (model, method, hardware).
        published_gib: The figure in GiB.
        published_text: The figure as published.
        setting: The planner's setting, in words.
        workload: Builds the planner's workload.
        unmatched: What the planner cannot match (beyond what all torchtune rows share); empty for nothing.
        config: The torchtune recipe config behind the figure.
    """

    key: str
    figure: str
    published_gib: float
    published_text: str
    setting: str
    workload: Callable[[], Workload]
    unmatched: str
    config: str


def published_cases() -> list[PublishedCase]:
    """torchtune's README figures with the settings of their recipe configs (bf16 weights, AC on, AdamW)."""
    c8, c70, c405 = _config("Llama-3.1-8B"), _config("Llama-3.1-70B"), _config("Llama-3.1-405B")
    ac = MemoryOptions(activation_checkpointing="full")
    tt = {"dtype": "bf16", "seq_len": 2048, "micro_batch_size": 2}  # README: batch 2, packed to 2048 tokens
    fsdp8, one = ParallelLayout().resolve(8), ParallelLayout().resolve(1)
    # torchtune trains the adapters in the model's dtype (bf16): peft's `autocast_adapter_dtype=False`.
    lora16 = LoraOptions(r=16, alpha=32, target_modules=TORCHTUNE_LORA_TARGETS, autocast_adapter_dtype=False)
    lora8 = LoraOptions(r=8, alpha=16, target_modules=TORCHTUNE_LORA_TARGETS, autocast_adapter_dtype=False)
    nf4 = "NF4 measured (NF4 tensors of the real sizes under FakeTensorMode: FSDP2 gathers them 4-bit, each matmul dequantizes)"
    return [
        PublishedCase(
            "70b_full",
            "Llama-3.1-70B full, 8x A100",
            13.9,
            "13.9 GiB (**)",
            "FSDP8, `cpu_offload=True`",
            lambda: Workload(c70, fsdp8, memory=replace(ac, cpu_offload=True), **tt),
            "(**) CPU offload with a fused optimizer: FSDP2 offload of parameters, gradients and AdamW state, as the"
            " planner models it; embeddings and output sharded as their own units (`custom_sharded_layers`)",
            "70B_full.yaml",
        ),
        PublishedCase(
            "70b_lora",
            "Llama-3.1-70B LoRA, 8x A100",
            27.6,
            "27.6 GiB",
            "FSDP8, LoRA r=16 a=32, bf16 adapters (`lora.autocast_adapter_dtype: false`)",
            lambda: Workload(c70, fsdp8, memory=ac, lora=lora16, **tt),
            "",
            "70B_lora.yaml",
        ),
        PublishedCase(
            "405b_qlora",
            "Llama-3.1-405B QLoRA, 8x A100",
            44.8e9 / GIB,
            "44.8 GB (41.7 GiB)",
            "FSDP8, LoRA r=16 a=32, NF4 base, bf16 adapters (`lora.autocast_adapter_dtype: false`)",
            lambda: Workload(c405, fsdp8, memory=ac, lora=replace(lora16, quantize="nf4"), **tt),
            f"the config says batch 1 x 8 accumulation steps (the README's batch 2 is used); {nf4}",
            "405B_qlora.yaml",
        ),
        PublishedCase(
            "8b_full",
            "Llama-3.1-8B full, 1x RTX 4090",
            18.9,
            "18.9 GiB",
            "1 GPU, `optim.name: adamw8bit`, `optimizer_in_backward`, `optimizer_offload`",
            lambda: Workload(
                c8, one, memory=replace(ac, optimizer_in_backward=True, optimizer_offload=True), optimizer="adamw8bit", **tt
            ),
            "bitsandbytes PagedAdamW8bit (8-bit state paged to host memory, outside `max_memory_allocated`) with"
            " `optimizer_in_bwd`: here torchao's AdamW8bit with its state and step on the host, each gradient applied"
            " and freed during backward",
            "8B_full_single_device.yaml",
        ),
        PublishedCase(
            "8b_lora",
            "Llama-3.1-8B LoRA, 1x RTX 4090",
            16.2,
            "16.2 GiB",
            "1 GPU, LoRA r=8 a=16, bf16 adapters (`lora.autocast_adapter_dtype: false`)",
            lambda: Workload(c8, one, memory=ac, lora=lora8, **tt),
            "",
            "8B_lora_single_device.yaml",
        ),
        PublishedCase(
            "8b_qlora",
            "Llama-3.1-8B QLoRA, 1x RTX 4090",
            7.4,
            "7.4 GiB",
            "1 GPU, LoRA r=8 a=16, NF4 base, bf16 adapters (`lora.autocast_adapter_dtype: false`)",
            lambda: Workload(c8, one, memory=ac, lora=replace(lora8, quantize="nf4"), **tt),
            nf4,
            "8B_qlora_single_device.yaml",
        ),
        PublishedCase(
            "405b_qlora_config_batch",
            "Llama-3.1-405B QLoRA, 8x A100, at its config's batch",
            44.8e9 / GIB,
            "44.8 GB (41.7 GiB)",
            "row 3 at 1 x 2048 tokens",
            lambda: Workload(
                c405, fsdp8, memory=ac, lora=replace(lora16, quantize="nf4"), **{**tt, "micro_batch_size": 1}
            ),
            "the recipe config's `batch_size: 1` (with 8 accumulation steps, which add nothing to the peak); at the"
            " README's batch 2 the floor alone (NF4 weights and the 126 layer inputs, 40.98 GiB) is 0.7 GiB under the"
            " published figure, less than the one gathered NF4 layer (~1.5 GiB) any FSDP2 step adds, so the figure"
            " cannot have been measured there",
            "405B_qlora.yaml",
        ),
        PublishedCase(
            "8b_lora_tiled",
            "Llama-3.1-8B LoRA, 1x RTX 4090, with the tiled MLP",
            16.2,
            "16.2 GiB",
            "row 5 with `memory.mlp_chunk_tokens: 512`, `memory.loss_chunk_tokens: 256`",
            lambda: Workload(
                c8, one, memory=replace(ac, mlp_chunk_tokens=512, loss_chunk_tokens=256), lora=lora8, **tt
            ),
            "the tiled MLP (one more MLP forward a step) and smaller loss chunks: the peak is then a tile's backward in"
            " the last layer, where the attention recomputed for all 4096 tokens (q, k, v, its output and the two"
            " norms' outputs: 0.14 GiB), the gradients flowing through the layer and the tile's tensors sit on the"
            " floor and the adapters' AdamW state (16.06 GiB)",
            "8B_lora_single_device.yaml",
        ),
    ]


#: LLaMA-Factory's "Hardware Requirement" rows (estimated; GB per B params): method, factor, and the planner's
#: setting: a torchtune row's dry run to reuse (same setting up to the adapters' targets), or a dtype to run.
LLAMA_FACTORY = (
    ("Full (`bf16` or `fp16`), 32 bits (AMP)", 18.0, "fp32"),
    ("Full (`pure_bf16`), 16 bits", 8.0, "bf16"),
    ("Freeze/LoRA/GaLore/APOLLO/BAdam/OFT, 16 bits", 2.0, "8b_lora"),
    ("QLoRA / QOFT, 4 bits", 0.5, "8b_qlora"),
)


#: Bytes per element of a workload's dtype.
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _tokens_per_gpu(workload: Workload, *, residual: bool) -> int:
    """Tokens of a micro-batch one GPU holds: split over context parallelism, and over TP too for the residual stream
    under sequence parallelism (``residual``); inside a TP region (the MLP's width split instead) not over TP."""
    layout = workload.layout
    split = layout.cp_size * (layout.tp_size if residual and workload.options.sequence_parallel else 1)
    return workload.micro_batch_size * workload.seq_len // split


def _floor(workload: Workload, worst: RankMemory) -> int:
    """What any engine holds at these settings once forward ends under full activation checkpointing: the weights
    resident on the GPU (as the dry run counts them) and each layer's input, kept for its recomputation."""
    assert workload.memory.activation_checkpointing == "full", "the floor assumes full activation checkpointing"
    tokens = _tokens_per_gpu(workload, residual=True)
    return worst.peak["parameters"] + worst.layers * tokens * workload.config.hidden_size * _BYTES[workload.dtype]


def _untiled_bound(workload: Workload, worst: RankMemory) -> int:
    """The least any engine that does not tile the sequence holds at these settings: the floor (:func:`_floor`), the
    optimizer state the dry run keeps on the GPU, one decoder layer's weights gathered when FSDP shards them (its
    linears at their storage size: NF4's 4 bits, its scales left out), and what the MLP's backward of the layer
    recomputed first needs at once: three ``[tokens, intermediate]`` tensors (the gradient of ``act(gate) * up``, and
    ``gate`` and ``up``, to take the two factors' gradients)."""
    layout, config, nbytes = workload.layout, workload.config, _BYTES[workload.dtype]
    mlp = 3 * _tokens_per_gpu(workload, residual=False) * config.intermediate_size // layout.tp_size * nbytes
    gathered = 0
    if layout.dp_shard_size > 1:
        layer = _meta_model(config, "AutoModelForCausalLM").model.layers[0]
        per_param = 0.5 if workload.lora is not None and workload.lora.quantize == "nf4" else nbytes
        linears = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
        gathered = int(linears * per_param) // layout.tp_size
    return _floor(workload, worst) + worst.peak["optimizer"] + gathered + mlp


def published_section() -> Section:
    """The dry run on the settings behind published fine-tuning memory figures."""
    header = [
        "#",
        "torchtune figure",
        "published",
        "planner setting",
        "planner peak GiB/GPU",
        "planner / published",
        "floor GiB/GPU",
        "least an untiled step holds, GiB/GPU",
        *[SHORT[n] for n in PEAK_CATEGORIES],
        "host GiB/node",
    ]
    rows, data, notes, done = [], [], [], {}
    for number, case in enumerate(published_cases(), 1):
        workload = case.workload()
        ranks, seconds = _timed_dry_run(workload)
        worst = done[case.key] = _worst(ranks)
        host = worst.host * min(8, workload.world_size)
        rows.append(
            [
                number,
                case.figure,
                case.published_text,
                case.setting,
                f"**{_gib(worst.total)}**",
                f"{worst.total / GIB / case.published_gib:.2f}",
                _gib(_floor(workload, worst)),
                _gib(_untiled_bound(workload, worst)),
                *[_gib(worst.peak[n]) for n in PEAK_CATEGORIES],
                _gib(host),
            ]
        )
        if case.unmatched:  # else nothing beyond what every row shares
            notes.append(f"{number}. [{case.config}]({TORCHTUNE_CONFIGS}/{case.config}): {case.unmatched}.")
        data.append(
            {
                "figure": f"torchtune {case.figure}",
                "published_gib": case.published_gib,
                "seconds": seconds,
                "ranks": [rank.as_dict() for rank in ranks],
            }
        )

    c8 = _config("Llama-3.1-8B")
    billions = deepspeed_params(c8)[0] / 1e9
    logits = 2 * 2048 * c8.vocab_size * 4
    lf_rows = []
    for method, factor, setting in LLAMA_FACTORY:
        if setting in done:
            worst, described = done[setting], f"row {[c.key for c in published_cases()].index(setting) + 1} above"
        else:
            workload = Workload(
                c8,
                ParallelLayout().resolve(1),
                memory=MemoryOptions(activation_checkpointing="full"),
                dtype=setting,
                seq_len=2048,
                micro_batch_size=2,
            )
            ranks, seconds = _timed_dry_run(workload)
            worst, described = _worst(ranks), f"1 GPU, {setting} weights, compute and AdamW state"
            data.append(
                {"figure": f"LLaMA-Factory {method}", "seconds": seconds, "ranks": [r.as_dict() for r in ranks]}
            )
        lf_rows.append(
            [
                method,
                f"{factor:g}x",
                f"{factor * billions:.1f}",
                described,
                f"{worst.total / 1e9:.1f}",
                f"{worst.total / 1e9 / billions:.2f}x",
                f"{sum(worst.state.values()) / 1e9 / billions:.2f}x",
            ]
        )
    lines = [
        "### Published fine-tuning memory figures vs the planner",
        "",
        (
            f'torchtune\'s README table ([README]({TORCHTUNE_README}), "Memory and training speed": peak memory'
            ' per GPU, "batch size 2 (without gradient accumulation), a dataset packed to sequence length 2048, and'
            ' torch compile enabled") with the settings of the recipe configs behind each row: bf16 weights (AdamW'
            " state in bf16 too), activation checkpointing on, AdamW, LoRA on q/v/o and the MLP with bf16 adapters"
            " (peft's `autocast_adapter_dtype=False`, recipe key `lora.autocast_adapter_dtype: false`). The planner runs"
            ' each as `dry_run` with `dtype="bf16"`, `activation_checkpointing="full"`, 2 rows x 2048 tokens; GiB at the'
            " worst rank kind's peak. The loss is chunked in both (torchtune's `LinearCrossEntropyLoss`; here"
            " `memory.loss_chunk_tokens`, 512 tokens by default), so neither holds the full-vocabulary fp32 logits"
            f" (2 x 2048 x {c8.vocab_size} x 4 B = {logits / GIB:.2f} GiB a copy). Not matched in any row:"
            " torch.compile (it changes the step time more than the peak)."
        ),
        "",
        *_table(header, rows, "rlllrrr" + "r" * len(PEAK_CATEGORIES) + "r"),
        "",
        *notes,
        "",
        (
            f'LLaMA-Factory\'s table ([README]({LLAMA_FACTORY_README}): "estimated", GB per B parameters for the'
            " whole job on one device; no batch size or sequence length given) against the planner for Llama-3.1-8B"
            f" ({billions:.2f}B parameters) on 1 GPU at the torchtune rows' settings (2 x 2048, activation"
            " checkpointing: LLaMA-Factory's default too; its default LoRA targets all linears with r=8, one more"
            " projection than torchtune's). AMP (fp32 master + bf16 compute) needs FSDP2 mixed precision, i.e. at least"
            " 2 data ranks: the planner refuses it on 1 GPU, so that row runs in fp32. GB = 10^9 bytes."
        ),
        "",
        *_table(
            [
                "method",
                "LLaMA-Factory",
                "LLaMA-Factory for 8B, GB",
                "planner setting",
                "planner peak GB",
                "planner peak per B params",
                "planner model states per B params",
            ],
            lf_rows,
            "lrrlrrr",
        ),
    ]
    return Section(lines, data)


# ------------------------------------------------------------------------------------------------------ calibration


def calibration_section() -> Section:
    """``calibration_table()``: published tokens/s/GPU against the step-time model."""
    from lightning_plugins.planner import calibration as module

    header = [
        "run",
        "kernels",
        "published tok/s/GPU",
        "predicted tok/s/GPU",
        "predicted / published",
        "predicted MFU",
        "efficiency used",
        "bubble",
        "exposed comm share",
        "issue's anchor",
        "source",
    ]
    tables = {"fitted": module.calibration_table(), "validation": module.calibration_table(module.VALIDATION)}
    lines = [
        "### Calibration of the step-time model",
        "",
        (
            f"`{module.__name__}.calibration_table()`: each published run's hardware, layout and settings through"
            " `estimate_step_time`, at the efficiency of its kernels class (`efficiency used`: the fraction of the"
            " dense bf16 peak the compute reaches). The efficiencies are fitted to these same runs (one per kernels"
            " class, the geometric mean of the efficiencies each run implies), so a ratio near 1 here shows that one"
            " number per class fits all of its runs, not an out-of-sample prediction."
        ),
    ]
    for kind, table in tables.items():
        rows = [
            [
                r["name"],
                r["kernels"],
                f"{r['published_tokens_per_s_per_gpu']:,.0f}",
                f"{r['predicted_tokens_per_s_per_gpu']:,.0f}",
                f"{r['ratio']:.3f}",
                f"{r['predicted_mfu']:.1%}",
                f"{r['efficiency']:.3f}",
                f"{r['bubble']:.1%}",
                f"{r['exposed_comm_share']:.1%}",
                "yes" if r["required"] else "",
                r["source"],
            ]
            for r in table
        ]
        if kind == "validation":
            lines += ["", "Not fitted (`VALIDATION`: long sequences, context parallel), at the fitted efficiencies:"]
        lines += ["", *_table(header, rows, "ll" + "r" * 7 + "ll")]
    return Section(lines, tables)


# ------------------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="small layouts: measured on gloo vs predicted")
    parser.add_argument("--real-size", action="store_true", help="8B / 70B / 405B: memory, dry-run time, estimators")
    parser.add_argument("--published", action="store_true", help="published fine-tuning memory figures vs predicted")
    parser.add_argument("--calibration", action="store_true", help="the step-time model's calibration table")
    parser.add_argument(
        "--max-405b-seconds",
        type=float,
        default=60.0,
        help="fail (exit 1) when the 405B interleaved dry run takes longer (default 60)",
    )
    add_report_arguments(parser, output=True, json_out=True)
    args = parser.parse_args(argv)
    chosen = [name for name in ("small", "real_size", "published", "calibration") if getattr(args, name)]
    chosen = chosen or ["small", "real_size", "published", "calibration"]

    sections: dict[str, Section] = {}
    passed = True
    with Timed() as run:
        for name in chosen:
            if name == "small":
                sections[name] = small_section()
            elif name == "real_size":
                sections[name], passed = real_size_section(args.max_405b_seconds)
            elif name == "published":
                sections[name] = published_section()
            else:
                sections[name] = calibration_section()
            print("\n".join(sections[name].lines) + "\n", flush=True)
    backend = "gloo and a fake process group" if "small" in chosen else "a fake process group"
    on = machine(run.load, packages=("transformers",), python=True, backend=backend)
    footer = [
        f"Command: `{command(argv)}` ({run.elapsed:.0f} s)",
        f"Machine: {on}. Date: {datetime.date.today().isoformat()}.",
    ]
    print("\n".join(footer))
    write_report(args.output, "\n".join(footer) + "\n\n" + "\n\n".join("\n".join(s.lines) for s in sections.values()))
    write_json(args.json, {name: s.data for name, s in sections.items()}, default=str)
    if not passed:
        print(
            f"FAILED: the 405B interleaved dry run took longer than --max-405b-seconds {args.max_405b_seconds:g}.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
