"""Calibration of the step-time model: published runs, their settings, and the efficiency per kernels class
they imply (:data:`~lightning_plugins.planner.timing.KERNELS` holds the fitted values; the tests refit them).

``python -c "from lightning_plugins.planner.calibration import print_calibration; print_calibration()"``
prints the table (published tokens/s/GPU next to the prediction).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.planner.hardware import GPUS, Cluster
from lightning_plugins.planner.model_stats import model_stats
from lightning_plugins.planner.timing import KERNELS, StepTime, estimate_step_time, torchtitan_op_sac

#: What torchtitan's Llama-3.1-8B FSDP runs share (Tables 1 and 3: local batch 2, selective op-level AC).
_TORCHTITAN_8B_FSDP: dict[str, Any] = {
    "model": "Llama-3.1-8B",
    "seq_len": 8192,
    "micro_batch_size": 2,
    "memory": {"activation_checkpointing": "selective", "param_dtype": "bf16", "reduce_dtype": "fp32"},
    "recompute": "torchtitan_op_sac",
}
#: What torchtitan's two 3D Llama-3.1-405B runs share (Table 5: they differ in the pipeline schedule only).
_TORCHTITAN_405B_3D: dict[str, Any] = {
    "model": "Llama-3.1-405B",
    "gpus": 512,
    "layout": {"pp_size": 8, "dp_shard_size": 8, "tp_size": 8},
    "seq_len": 8192,
    "micro_batch_size": 32,
    "global_batch_size": 256,
    "memory": {
        "activation_checkpointing": "full",
        "param_dtype": "bf16",
        "reduce_dtype": "fp32",
        "reshard_after_forward": False,
    },
    "kernels": "compile_float8",
    "async_tp": True,
    "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5 (3D, compile + Float8 + AsyncTP)",
}

#: Published runs with the settings they were run with. Sources:
#: torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (H100 96 GB HBM2e at 500 W, 8 per node, 400 Gb/s
#: RDMA per GPU; seq_len 8192 from its ``train_configs/llama3_*.toml`` at commit 9dec370, AdamW, FSDP2 bf16
#: parameters with fp32 gradient reduction, pipeline micro-batches = pp degree); Llama 3 paper (Dubey et al.
#: 2024, Table 4: 700 W H100 80 GB, bf16; TFLOP/s per GPU, converted with this model's FLOP count).
#: ``local batch`` in torchtitan is rows per data rank per step, which is our micro_batch_size.
CALIBRATION: tuple[dict[str, Any], ...] = (
    {
        "name": "torchtitan Llama-3.1-8B FSDP8, 8 H100",
        **_TORCHTITAN_8B_FSDP,
        "gpus": 8,
        "layout": {"dp_shard_size": 8},
        "global_batch_size": 16,
        "kernels": "bf16",
        "published_tokens_per_s_per_gpu": 5762,
        "required": True,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP, eager, selective op AC)",
    },
    {
        "name": "torchtitan Llama-3.1-8B FSDP128, 128 H100",
        **_TORCHTITAN_8B_FSDP,
        "gpus": 128,
        "layout": {"dp_shard_size": 128},
        "global_batch_size": 256,
        "kernels": "bf16",
        "published_tokens_per_s_per_gpu": 5605,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 3 (FSDP, eager, selective op AC)",
    },
    {
        "name": "torchtitan Llama-3.1-8B FSDP8, 8 H100, compile",
        **_TORCHTITAN_8B_FSDP,
        "gpus": 8,
        "layout": {"dp_shard_size": 8},
        "global_batch_size": 16,
        "kernels": "compile",
        "published_tokens_per_s_per_gpu": 6667,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP + torch.compile)",
    },
    {
        "name": "torchtitan Llama-3.1-8B FSDP8, 8 H100, compile + float8",
        **_TORCHTITAN_8B_FSDP,
        "gpus": 8,
        "layout": {"dp_shard_size": 8},
        "global_batch_size": 16,
        "kernels": "compile_float8",
        "published_tokens_per_s_per_gpu": 8532,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP + torch.compile + Float8)",
    },
    {
        "name": "torchtitan Llama-3.1-70B FSDP32 x TP8, 256 H100",
        "model": "Llama-3.1-70B",
        "gpus": 256,
        "layout": {"dp_shard_size": 32, "tp_size": 8},
        "seq_len": 8192,
        "micro_batch_size": 16,
        "global_batch_size": 512,
        "memory": {"activation_checkpointing": "full", "param_dtype": "bf16", "reduce_dtype": "fp32"},
        "kernels": "compile_float8",
        "published_tokens_per_s_per_gpu": 829,
        "required": True,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4 (2D, compile + Float8, full AC)",
    },
    {
        "name": "torchtitan Llama-3.1-405B FSDP8 x TP8 x PP8 1F1B, 512 H100",
        **_TORCHTITAN_405B_3D,
        "options": {"pp_schedule": "1f1b", "pp_microbatches": 8},
        "published_tokens_per_s_per_gpu": 100,
    },
    {
        "name": "torchtitan Llama-3.1-405B FSDP8 x TP8 x PP8 interleaved 1F1B, 512 H100",
        **_TORCHTITAN_405B_3D,
        "options": {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 8, "pp_stages_per_rank": 2},
        "published_tokens_per_s_per_gpu": 128,
        "required": True,
    },
    *(
        {
            "name": f"Llama 3 paper 405B {name}, {gpus:,} H100 ({mfu}% MFU)",
            "model": "Llama-3.1-405B",
            "gpus": gpus,
            "layout": {"pp_size": 16, "dp_shard_size": dp, "cp_size": cp, "tp_size": 8},
            # Interleaved 1F1B, one sequence per micro-batch. The paper's stages per rank are not published: 2
            # assumed (126 layers with one fewer in the first and last stage fit 1, 2 or 4 stages per rank).
            "options": {
                "pp_schedule": "interleaved_1f1b",
                "pp_microbatches": rows,
                "pp_stages_per_rank": 2,
                "cp_backend": "ring",
            },
            "seq_len": seq,
            "micro_batch_size": rows,
            "global_batch_size": rows * dp,
            # No activation checkpointing at 8K (paper, 3.3.2); FSDP without resharding after forward; fp32
            # gradient reduce-scatter.
            "memory": {"param_dtype": "bf16", "reduce_dtype": "fp32", "reshard_after_forward": False},
            "kernels": "llama3",
            "published_tflops_per_gpu": tflops,
            "required": required,
            "source": "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4",
        }
        for name, gpus, dp, cp, seq, rows, tflops, mfu, required in (
            ("TP8 x PP16 x DP128, 8K", 16384, 128, 1, 8192, 16, 400, 41, True),
            ("TP8 x PP16 x DP64, 8K", 8192, 64, 1, 8192, 32, 430, 43, False),
            ("TP8 x CP16 x PP16 x DP8, 128K", 16384, 8, 16, 131072, 16, 380, 38, False),
        )
    ),
)

#: Published runs the fit does not use, shown next to it: long sequences with context parallelism, where
#: attention dominates (torchtitan Table 2: Llama-3.1-8B, 8 H100, compile + float8, full AC, local batch 1).
VALIDATION: tuple[dict[str, Any], ...] = tuple(
    {
        "name": f"torchtitan Llama-3.1-8B FSDP{fsdp} x CP{cp} at {seq // 1024}K, 8 H100, compile + float8",
        "model": "Llama-3.1-8B",
        "gpus": 8,
        "layout": {"dp_shard_size": fsdp, "cp_size": cp},
        "options": {"cp_backend": "ring"},
        "seq_len": seq,
        "micro_batch_size": 1,
        "global_batch_size": fsdp,
        "memory": {"activation_checkpointing": "full", "param_dtype": "bf16", "reduce_dtype": "fp32"},
        "kernels": "compile_float8",
        "published_tokens_per_s_per_gpu": tps,
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 2 (FSDP + CP + compile + Float8)",
    }
    for fsdp, cp, seq, tps in ((8, 1, 32768, 3890), (4, 2, 65536, 2540), (2, 4, 131072, 1071), (1, 8, 262144, 548))
)


def calibration_cluster(run: dict[str, Any], mfu: float | None = None) -> Cluster:
    """The cluster a calibration run used (H100 SXM figures; torchtitan's were 500 W HBM2e parts)."""
    return Cluster(GPUS[run.get("gpu", "H100")], gpus=run["gpus"], gpus_per_node=run.get("gpus_per_node", 8), mfu=mfu)


def predict(run: dict[str, Any], efficiency: float | None = None) -> StepTime:
    """The step-time model's estimate for a calibration run (at ``efficiency``, else its class's)."""
    from lightning_plugins.planner.model_stats import load_model_config

    stats = model_stats(load_model_config(run["model"]))
    cluster = calibration_cluster(run)
    kernels = KERNELS[run["kernels"]]
    if efficiency is not None:
        kernels = replace(kernels, efficiency=efficiency)
    layout = ParallelLayout(**run["layout"]).resolve(run["gpus"])
    recompute = torchtitan_op_sac(stats) if run.get("recompute") == "torchtitan_op_sac" else None
    return estimate_step_time(
        stats,
        layout,
        ParallelOptions(**run.get("options", {})),
        MemoryOptions(**run.get("memory", {})),
        cluster,
        seq_len=run["seq_len"],
        micro_batch_size=run["micro_batch_size"],
        global_batch_size=run["global_batch_size"],
        kernels=kernels,
        async_tp=run.get("async_tp", False),
        recompute_fraction=recompute,
        float8_tp=kernels.float8,  # torchtitan's float8 runs use torchao's float8 TP styles
    )


def published_tokens_per_s(run: dict[str, Any]) -> float:
    """The run's published tokens/s/GPU (a TFLOP/s figure is converted with this model's FLOPs per token)."""
    if "published_tokens_per_s_per_gpu" in run:
        return float(run["published_tokens_per_s_per_gpu"])
    from lightning_plugins.planner.model_stats import load_model_config

    stats = model_stats(load_model_config(run["model"]))
    return run["published_tflops_per_gpu"] * 1e12 / stats.flops_per_token(run["seq_len"])


def implied_efficiency(run: dict[str, Any]) -> float:
    """The efficiency at which the model reproduces ``run`` exactly (bisection; throughput rises with it)."""
    target = published_tokens_per_s(run)
    low, high = 0.01, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if predict(run, mid).tokens_per_s_per_gpu < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def fit_efficiencies(runs: tuple[dict[str, Any], ...] = CALIBRATION) -> dict[str, float]:
    """One efficiency per kernels class: the geometric mean of its runs' implied efficiencies.

    Classes whose attention runs at another class's efficiency are fitted after that class (the fit is
    applied to :data:`KERNELS` while it runs and restored afterwards).
    """
    saved = dict(KERNELS)
    fitted: dict[str, float] = {}
    order = sorted({run["kernels"] for run in runs}, key=lambda name: KERNELS[name].attention is not None)
    try:
        for name in order:
            implied = [implied_efficiency(run) for run in runs if run["kernels"] == name]
            fitted[name] = math.exp(sum(map(math.log, implied)) / len(implied))
            KERNELS[name] = replace(KERNELS[name], efficiency=fitted[name])
    finally:
        KERNELS.clear()
        KERNELS.update(saved)
    return fitted


def calibration_table(runs: tuple[dict[str, Any], ...] = CALIBRATION) -> list[dict[str, Any]]:
    """Each run: published and predicted tokens/s/GPU, their ratio, MFU, the efficiency and bubble used."""
    rows = []
    for run in runs:
        step = predict(run)
        published = published_tokens_per_s(run)
        rows.append(
            {
                "name": run["name"],
                "kernels": run["kernels"],
                "published_tokens_per_s_per_gpu": published,
                "predicted_tokens_per_s_per_gpu": step.tokens_per_s_per_gpu,
                "ratio": step.tokens_per_s_per_gpu / published,
                "predicted_mfu": step.mfu,
                "efficiency": step.efficiency,
                "bubble": step.bubble,
                "exposed_comm_share": step.exposed_comm_s / step.step_s,
                "required": bool(run.get("required")),
                "source": run["source"],
            }
        )
    return rows


def format_calibration(rows: list[dict[str, Any]]) -> str:
    """The calibration table as text."""
    lines = [f"{'run':<74} {'published':>10} {'predicted':>10} {'ratio':>6} {'MFU':>6} {'bubble':>7}"]
    for row in rows:
        lines.append(
            f"{row['name']:<74} {row['published_tokens_per_s_per_gpu']:>10,.0f}"
            f" {row['predicted_tokens_per_s_per_gpu']:>10,.0f} {row['ratio']:>6.2f} {row['predicted_mfu']:>6.1%}"
            f" {row['bubble']:>7.1%}"
        )
    return "\n".join(lines)


def print_calibration(refit: bool = False) -> None:
    """Print the calibration (and, with ``refit``, the efficiencies the runs imply next to :data:`KERNELS`'s)."""
    if refit:
        fitted = fit_efficiencies()
        print("refitted efficiencies:", {k: round(v, 3) for k, v in fitted.items()})
        print("KERNELS efficiencies: ", {k: v.efficiency for k, v in KERNELS.items()})
    print(format_calibration(calibration_table()))
    print("Not fitted (long sequences, context parallel):")
    print(format_calibration(calibration_table(VALIDATION)))
