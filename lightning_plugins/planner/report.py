"""A plan: a workload's dry-run memory per kind of rank and its step time, against a cluster.

:func:`plan` runs both models; :class:`Plan` says whether it fits (each GPU's peak under its memory less a
safety margin; each node's host memory, the larger of loading and training, under what the node has:
:mod:`lightning_plugins.planner.host_memory`), which lever helps most when it does not, and prints itself as a
table or JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_plugins.planner.dryrun import dry_runs
from lightning_plugins.planner.rank_memory import PEAK_CATEGORIES, RankMemory, korthikanti_activations
from lightning_plugins.planner.hardware import GIB, Cluster
from lightning_plugins.planner.host_memory import HostMemory, host_advice, node_host_memory
from lightning_plugins.planner.timing import StepTime, estimate_step_time
from lightning_plugins.planner.workload import Workload

#: Share of each GPU's memory kept free: the CUDA context, NCCL buffers and allocator fragmentation.
DEFAULT_MARGIN = 0.10


@dataclass
class Plan:
    """What a workload needs on a cluster: memory per kind of rank (dry run) and the step time (model)."""

    workload: Workload
    cluster: Cluster
    ranks: list[RankMemory]
    step: StepTime
    margin: float = DEFAULT_MARGIN

    @property
    def budget(self) -> int:
        """Bytes of one GPU a rank may use: its memory less the margin."""
        return int(self.cluster.memory * (1 - self.margin))

    @property
    def peak(self) -> int:
        """The largest peak of any rank."""
        return max(rank.total for rank in self.ranks)

    @property
    def host(self) -> HostMemory:
        """Each node's host memory by phase and term."""
        return node_host_memory(self.workload, self.cluster, self.ranks)

    @property
    def host_per_node(self) -> int:
        """Host bytes per node: the larger of the loading and the training phase (they never coexist)."""
        return self.host.per_node

    @property
    def gpu_fits(self) -> bool:
        return self.peak <= self.budget

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host.fits

    def advice(self) -> list[str]:
        """What would make a plan that does not fit fit, the lever that saves most first (estimates)."""
        lines = [] if self.gpu_fits else self._gpu_advice()
        host = self.host
        if not host.fits:
            over = host.per_node - host.limit
            lines += [
                f"{setting} (saves ~{saved / GIB:.0f} GiB of host memory per node"
                f"{'' if saved >= over else ', not enough alone'})"
                for saved, setting in sorted(
                    host_advice(host, self.workload, self.cluster, gpu_room=self.budget - self.peak), reverse=True
                )
            ]
            lines.append(
                f"hardware.host_memory_gb: the nodes' real host memory, if it is more than the {host.limit / GIB:.0f}"
                " GiB planned against"
            )
        return lines

    def _gpu_advice(self) -> list[str]:
        worst = max(self.ranks, key=lambda rank: rank.total)
        workload, layout, memory = self.workload, self.workload.layout, self.workload.memory
        levers: list[tuple[int, str]] = []
        if memory.activation_checkpointing != "full":
            full = replace(workload, memory=replace(memory, activation_checkpointing="full"))
            keeps = korthikanti_activations(full, 1) / max(1, korthikanti_activations(workload, 1))
            levers.append((int(worst.peak["activations"] * (1 - keeps)), "memory.activation_checkpointing: full"))
        samples = workload.micro_batch_size // workload.rows_per_sample  # the recipe's count: pairs, or rows
        if samples > 1:
            levers.append((worst.peak["activations"] // 2, f"train.micro_batch_size: {samples // 2}"))
        if not memory.cpu_offload and layout.fsdp_size > 1:
            state = worst.peak["parameters"] + worst.peak["gradients"] + worst.peak["optimizer"]
            levers.append((min(state, sum(worst.state.values())), "memory.cpu_offload: true"))
        tp = layout.tp_size * 2
        if tp <= self.cluster.gpus_per_node and workload.config.num_key_value_heads % tp == 0:
            levers.append((worst.total // 2 - worst.peak["temporaries"] // 2, f"layout.tp_size: {tp}"))
        if layout.tp_size > 1 and not workload.options.loss_parallel:
            levers.append((worst.peak["temporaries"] // 2, "parallel.loss_parallel: true"))
        over = worst.total - self.budget
        return [
            f"{setting} (saves ~{saved / GIB:.1f} GiB per GPU{'' if saved >= over else ', not enough alone'})"
            for saved, setting in sorted(levers, reverse=True)
        ]

    def as_dict(self) -> dict[str, Any]:
        layout = self.workload.layout
        return {
            "model": getattr(self.workload.config, "_name_or_path", "") or self.workload.config.model_type,
            "method": self.workload.method,
            "objective": self.workload.objective.method,
            "layout": {
                "pp": layout.pp_size,
                "dp_replicate": layout.dp_replicate_size,
                "dp_shard": layout.dp_shard_size,
                "cp": layout.cp_size,
                "tp": layout.tp_size,
                "ep": layout.ep_size,
            },
            "activation_checkpointing": self.workload.memory.activation_checkpointing,
            "cpu_offload": self.workload.memory.cpu_offload,
            "seq_len": self.workload.seq_len,
            "images": self.workload.images.as_dict() if self.workload.images is not None else None,
            "micro_batch_size": self.workload.micro_batch_size,
            "global_batch_size": self.workload.global_batch_size,
            "gpu": self.cluster.gpu.name,
            "gpu_memory": self.cluster.memory,
            "budget": self.budget,
            "fits": self.fits,
            "ranks": [rank.as_dict() for rank in self.ranks],
            "host_per_node": self.host_per_node,
            "host": self.host.as_dict(),
            "step": self.step.as_dict(),
            "advice": self.advice(),
        }

    def describe(self) -> str:
        """The plan as a console report: a table per kind of rank, the verdict, the step time and its assumptions."""
        w, layout = self.workload, self.workload.layout
        unit, size = ("GiB", GIB) if self.peak >= GIB else ("MiB", 2**20)
        lines = [
            f"{w.method} fine-tune{_objective(w)}, layout pp={layout.pp_size} dp_replicate={layout.dp_replicate_size}"
            f" dp_shard={layout.dp_shard_size} cp={layout.cp_size} tp={layout.tp_size}"
            f" ({layout.world_size} x {self.cluster.gpu.name} {self.cluster.memory / GIB:.0f} GiB),"
            f" seq {w.seq_len}, micro-batch {w.micro_batch_size}{_pairs(w)}, AC {w.memory.activation_checkpointing}"
            + (", CPU offload" if w.memory.cpu_offload else ""),
            *([w.images.describe(w.seq_len, w.lora is not None)] if w.images is not None else []),
            "",
            f"{unit} per GPU at the step's peak (dry run on a fake process group; activations measured):",
            f"{'rank kind':<14}{'layers':>7}"
            + "".join(f"{name[:11]:>12}" for name in PEAK_CATEGORIES)
            + f"{'total':>9}",
        ]
        for rank in self.ranks:
            lines.append(
                f"{rank.kind:<14}{rank.layers:>7}"
                + "".join(f"{rank.peak[name] / size:>12.2f}" for name in PEAK_CATEGORIES)
                + f"{rank.total / size:>9.2f}"
            )
        for rank in self.ranks:
            formula = korthikanti_activations(w, rank.layers)
            held = " per micro-batch (a pipeline stage holds several at once)" if layout.pp_size > 1 else ""
            lines.append(
                f"  {rank.kind}: activations at the peak {rank.peak['activations'] / size:.2f} {unit} measured;"
                f" Korthikanti et al.'s formula gives {formula / size:.2f} {unit} for {rank.layers} layer(s){held}."
                " The measured figure is reported."
            )
            lines += [f"  {rank.kind}: {note}" for note in rank.notes]
        lines += ["", *self.host.describe()]
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        host = self.host
        over = "" if host.fits else f"; host {host.per_node / GIB:.1f} GiB per node against {host.limit / GIB:.0f} GiB"
        lines += [
            "",
            f"{verdict}: peak {self.peak / size:.1f} {unit} against {self.budget / GIB:.1f} GiB"
            f" ({self.cluster.memory / GIB:.0f} GiB less a {self.margin:.0%} margin){over}",
        ]
        lines += [f"  try: {line}" for line in self.advice()]
        s = self.step
        lines += [
            "",
            f"Step time ~{s.step_s:.2f} s: {s.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {s.mfu:.1%},"
            f" pipeline bubble {s.bubble:.1%} (estimate, +-25%)",
        ]
        lines += [f"  assumes: {line}" for line in s.assumptions]
        return "\n".join(lines)


def _objective(workload: Workload) -> str:
    method = workload.objective.method
    reference = ""
    if workload.objective.needs_reference:
        frozen = workload.objective.frozen_copy(workload.lora)
        reference = ", reference: " + ("a frozen copy, sharded like the model" if frozen else "the base, adapters off")
    return "" if method == "sft" else f" ({method}{reference})"


def _pairs(workload: Workload) -> str:
    if workload.packed_pairs:
        return " packed rows (whole pairs)"
    return f" rows ({workload.micro_batch_size // 2} pairs)" if workload.objective.paired else ""


def step_time(workload: Workload, cluster: Cluster) -> StepTime:
    """The step-time model's estimate for ``workload`` on ``cluster``."""
    return estimate_step_time(
        workload.config,
        workload.layout,
        workload.options,
        workload.memory,
        cluster,
        seq_len=workload.seq_len,
        micro_batch_size=workload.micro_batch_size,
        global_batch_size=workload.global_batch_size,
        method=workload.method,
        lora=workload.lora,
        no_grad_forwards=workload.objective.no_grad_forwards,
        vision=None if workload.images is None else workload.images.compute(lora=workload.lora is not None),
    )


def plan(workload: Workload, cluster: Cluster, *, margin: float = DEFAULT_MARGIN) -> Plan:
    """Dry-run ``workload`` and estimate its step time on ``cluster``."""
    return plans([(workload, cluster)], margin=margin)[0]


def plans(jobs: list[tuple[Workload, Cluster]], *, margin: float = DEFAULT_MARGIN) -> list[Plan]:
    """:func:`plan` of each ``(workload, cluster)``, their dry runs in one pool of processes."""
    steps = [step_time(workload, cluster) for workload, cluster in jobs]
    ranks = dry_runs([workload for workload, _ in jobs])
    return [Plan(workload, cluster, r, step, margin) for (workload, cluster), r, step in zip(jobs, ranks, steps)]


def plan_recipe(
    recipe: Any,
    *,
    margin: float = DEFAULT_MARGIN,
    gpu: str | None = None,
    gpu_memory: Any = None,
    host_memory: Any = None,
) -> Plan:
    """Dry-run a loaded recipe (:func:`lightning_plugins.recipe.schema.load_recipe`) on the hardware it names.

    ``gpu``, ``gpu_memory`` (``"48GiB"``) and ``host_memory`` (``"1TiB"``) replace the recipe's ``hardware.gpu`` /
    ``hardware.gpu_memory_gb`` / ``hardware.host_memory_gb``.
    """
    return plan_recipes([recipe], margin=margin, gpu=gpu, gpu_memory=gpu_memory, host_memory=host_memory)[0]


def plan_recipes(
    recipes: list[Any],
    *,
    margin: float = DEFAULT_MARGIN,
    gpu: str | None = None,
    gpu_memory: Any = None,
    host_memory: Any = None,
) -> list[Plan]:
    """:func:`plan_recipe` of each recipe, their dry runs in one pool of processes."""
    jobs = [
        (Workload.from_recipe(recipe), recipe_cluster(recipe, gpu=gpu, gpu_memory=gpu_memory, host_memory=host_memory))
        for recipe in recipes
    ]
    return plans(jobs, margin=margin)


def recipe_cluster(recipe: Any, *, gpu: str | None = None, gpu_memory: Any = None, host_memory: Any = None) -> Cluster:
    """The cluster a recipe's ``hardware`` section names, with ``gpu`` / ``gpu_memory`` / ``host_memory`` (the
    command line's) in place of its own."""
    from lightning_plugins.planner.hardware import cluster_from

    hardware = recipe.hardware
    return cluster_from(
        gpu or hardware.gpu or "H100",
        gpus=hardware.world_size,
        gpus_per_node=hardware.devices,
        gpu_memory=gpu_memory or (f"{hardware.gpu_memory_gb}GiB" if hardware.gpu_memory_gb else None),
        host_memory=host_memory or (f"{hardware.host_memory_gb}GiB" if hardware.host_memory_gb else None),
    )
