"""The memory of candidate layouts as stacked bars next to the GPU's capacity (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from lightning_plugins.planner.rank_memory import PEAK_CATEGORIES
from lightning_plugins.planner.report import Plan
from lightning_plugins.planner.hardware import GIB
from lightning_plugins.planner.workload import Workload


def plot_plans(plans: list[Plan], path: str | Path, *, labels: list[str] | None = None) -> Path:
    """One stacked bar per plan (its busiest rank's peak by category), the GPU memory and the budget as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [layout_label(plan.workload) for plan in plans]
    figure, axes = plt.subplots(figsize=(max(6, 1.3 * len(plans) + 3), 4.5))
    bottoms = [0.0] * len(plans)
    for category in PEAK_CATEGORIES:
        heights = [max(p.ranks, key=lambda r: r.total).peak[category] / GIB for p in plans]
        axes.bar(labels, heights, bottom=bottoms, label=category)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    capacity = plans[0].cluster.memory / GIB
    axes.axhline(capacity, color="black", linewidth=1.5, label=f"{plans[0].cluster.gpu.name} memory")
    axes.axhline(plans[0].budget / GIB, color="black", linestyle="--", linewidth=1, label="budget (less margin)")
    axes.set_ylabel("GiB per GPU at the step's peak (busiest rank)")
    axes.set_title(
        f"{plans[0].workload.method} fine-tune, {plans[0].cluster.gpus} GPUs, seq {plans[0].workload.seq_len}"
    )
    axes.tick_params(axis="x", labelrotation=20)
    axes.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def layout_label(workload: Workload) -> str:
    """A short name of a workload's layout and levers, e.g. ``tp8 pp2 fsdp4 AC:full mb1``."""
    layout, memory = workload.layout, workload.memory
    parts = [
        f"{name}{size}"
        for name, size in (
            ("tp", layout.tp_size),
            ("cp", layout.cp_size),
            ("pp", layout.pp_size),
            ("rep", layout.dp_replicate_size),
            ("fsdp", layout.dp_shard_size),
            ("ep", layout.ep_size),
        )
        if size > 1
    ]
    parts.append(f"AC:{memory.activation_checkpointing}")
    if memory.cpu_offload:
        parts.append("offload")
    parts.append(f"mb{workload.micro_batch_size}")
    return " ".join(parts) or "1 GPU"
