"""The step-time model's assumptions: the constants it charges, and what it assumed for a step, in words.

:func:`lightning_plugins.planner.timing.estimate_step_time` charges these constants (recomputation of the
elementwise ops, QLoRA's dequantisation, async TP, AdamW on the host) and reports :func:`step_assumptions` with
every estimate, so a plan says what it took for granted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_plugins.parallel.options import MemoryOptions
from lightning_plugins.planner.attention_kernels import attention_lines
from lightning_plugins.planner.hardware import Cluster
from lightning_plugins.planner.model_stats import ModelStats
from lightning_plugins.planner.step_shape import StepShape

if TYPE_CHECKING:
    from lightning_plugins.planner.timing import Kernels

#: Op-level selective checkpointing (the engine's: matmul and attention outputs saved) re-runs the norms,
#: SwiGLU, rotary and residual ops. They do few FLOPs but are memory-bound: for a Llama-3.1-8B layer at 8K
#: tokens ~300 KB of HBM traffic per token against ~570 MFLOP per token, ~8% of the layer's forward time on
#: an H100. Charged as this fraction of the layer's forward FLOPs.
SELECTIVE_RECOMPUTE = 0.1
#: QLoRA over LoRA: NF4 weights are dequantised before every matmul (forward, input gradient, recompute).
#: Measured 1.39x the LoRA run time for a 7B model on an A100 (S. Raschka, "Practical Tips for Finetuning
#: LLMs Using LoRA", 2023: "39% increased runtime" for 33% less memory).
QLORA_SLOWDOWN = 1.39
#: Async TP (micro-pipelined matmul + collective) hides this share of the TP collectives. torchtitan's async-TP
#: benchmark (Llama 3 70B, FSDP32 x TP8, H100) gains 9% (bf16) to 16% (float8) with TP collectives ~18-20%
#: of the step in this model: roughly half of them hidden.
ASYNC_TP_HIDDEN = 0.5
#: AdamW on the host (FSDP2 CPU offload and optimizer offload run the optimizer there), parameters per second per
#: GPU's share of the node's cores and memory bandwidth: ~28 bytes of fp32 state read and written per parameter at
#: ~30 GB/s. (One H100 host's 16 cores ran the fused CPU AdamW at 2.9e9 parameters/s for a single GPU:
#: benchmarks/offload_gpu_h100.json.)
HOST_ADAM_PARAMS_PER_S = 1e9


def step_assumptions(
    shape: StepShape,
    memory: MemoryOptions,
    cluster: Cluster,
    kern: Kernels,
    efficiency: float,
    method: str,
    async_tp: bool,
    recompute_fraction: float | None,
    stats: ModelStats,
) -> tuple[str, ...]:
    """What :func:`lightning_plugins.planner.timing.estimate_step_time` assumed for this step, one line each."""
    lines = _compute_lines(memory, cluster, kern, efficiency, method, recompute_fraction)
    lines += _data_parallel_lines(shape, memory, cluster)
    lines += _model_parallel_lines(shape, cluster, async_tp)
    lines += attention_lines(stats, shape.cp_backend, shape.layout.cp_size)
    lines += _offload_lines(memory, cluster)
    reference = "the base, adapters off" if method in ("lora", "qlora") else "a frozen copy laid out like the model"
    if shape.no_grad_forwards == 1:
        lines.append(
            f"DPO: each micro-batch's rows are its pairs' chosen and rejected sequences, and the reference"
            f" ({reference}) runs one more forward of them without backward: its FLOPs and collectives"
        )
    elif shape.no_grad_forwards:
        lines.append(
            f"KTO: each row has a KL row (its prompt, another row's completion; as many tokens counted), and"
            f" {shape.no_grad_forwards} forwards run without backward: the policy's of the KL rows, the reference's"
            f" ({reference}) of the rows and of the KL rows: their FLOPs and collectives"
        )
    step_on_gpu = "" if memory.cpu_offload or memory.optimizer_offload else "optimizer step on the GPU, "
    lines.append(f"{step_on_gpu}data loading and logging: not counted")
    return tuple(lines)


def _link(cluster: Cluster, extent: int) -> str:
    name, bw = cluster.link(extent)
    return f"{name} {bw / 1e9:.0f} GB/s per GPU"


def _compute_lines(
    memory: MemoryOptions, cluster: Cluster, kern: Kernels, efficiency: float, method: str,
    recompute_fraction: float | None,
) -> list[str]:  # fmt: skip
    """The compute's efficiency, the FLOPs counted, the recomputation, QLoRA's slowdown."""
    gpu = cluster.gpu
    source = "set by Cluster.mfu" if cluster.mfu is not None else f"calibrated on {kern.description}"
    peak = f"{gpu.peak_flops / 1e12:.0f} TFLOP/s"
    lines = [
        f"compute at {efficiency:.1%} of the {gpu.name} dense bf16 peak of {peak} ({source})",
        "FLOPs per token: 6N + 12 x layers x heads x head_dim x seq (torchtitan's MFU convention; attention not"
        " halved for the causal mask)" + ("; frozen base 4N" if method != "full" else ""),
    ]
    if recompute_fraction is not None:
        lines.append(f"recomputation: {recompute_fraction:.0%} of each layer's forward")
    elif memory.activation_checkpointing == "full":
        lines.append("full activation checkpointing: one more forward of every layer")
    elif memory.activation_checkpointing == "selective":
        lines.append(
            f"selective checkpointing: every {memory.every_n_layers}-th layer recomputed"
            if memory.every_n_layers
            else f"op-level selective checkpointing: elementwise ops recomputed, {SELECTIVE_RECOMPUTE:.0%} of a"
            " layer's forward"
        )
    if method == "qlora":
        lines.append(f"QLoRA: NF4 dequantisation makes compute {QLORA_SLOWDOWN:.2f}x LoRA's")
    return lines


def _data_parallel_lines(shape: StepShape, memory: MemoryOptions, cluster: Cluster) -> list[str]:
    """FSDP's gathers and reductions, HSDP's all-reduce."""
    layout, lines = shape.layout, []
    t, c = layout.tp_size, layout.cp_size
    fsdp = layout.dp_shard_size * c
    if fsdp > 1:
        regather = memory.reshard_after_forward and not shape.split_backward
        reductions = "per backward"
        if layout.pp_size > 1 and memory.pp_reshard_per_microbatch:
            gathers, reductions = "per micro-batch forward and backward", "per micro-batch"
        elif layout.pp_size > 1:
            gathers = "per micro-batch forward and backward" if regather else "once per pipeline step"
        else:
            gathers = "per forward and again per backward" if regather else "per forward"
        lines.append(
            f"FSDP over {fsdp} ranks on {_link(cluster, t * fsdp)}: parameters all-gathered {gathers}, gradients reduce-scattered"
            f" {reductions}; overlapped with compute except the first gather / last reduce-scatter and any excess"
            " over compute"
        )
    if layout.dp_replicate_size > 1:
        replicas = layout.dp_replicate_size
        lines.append(
            f"HSDP: gradient all-reduce over {replicas} replicas on {_link(cluster, t * fsdp * replicas)}, overlapped like FSDP"
        )
    return lines


def _model_parallel_lines(shape: StepShape, cluster: Cluster, async_tp: bool) -> list[str]:
    """Tensor, context and pipeline parallelism's communication, and the bubble."""
    layout, lines = shape.layout, []
    t, c = layout.tp_size, layout.cp_size
    if t > 1:
        hidden = f", {ASYNC_TP_HIDDEN:.0%} hidden by async TP" if async_tp else ", exposed (not overlapped)"
        lines.append(
            f"TP {t} on {_link(cluster, t)}: {'all-gather + reduce-scatter' if shape.sequence_parallel else 'all-reduce'} of the"
            f" activations twice per layer, forward and backward{hidden}"
        )
    if c > 1:
        how = (
            "ring: K/V passed cp-1 times per layer, hidden behind attention"
            if shape.cp_backend == "ring"
            else "Ulysses: 4 all-to-alls per layer forward and backward, exposed"
        )
        lines.append(f"CP {c} on {_link(cluster, c * t)}: {how}")
    if layout.pp_size > 1:
        bubble = shape.bubble_fraction()
        zero = " (zero-bubble schedule: assumed 0, needs pp_microbatches >= 2 x pp_size)" if bubble == 0 else ""
        lines.append(
            f"PP {layout.pp_size} ({shape.schedule}, {shape.microbatches} micro-batches, {shape.stages_per_rank}"
            f" stage(s) per rank): bubble {bubble:.1%} of the pipeline's time{zero}; activations point-to-point on"
            f" {_link(cluster, layout.world_size)}, exposed on fill and drain only"
        )
    return lines


def _offload_lines(memory: MemoryOptions, cluster: Cluster) -> list[str]:
    """CPU offload's and optimizer offload's transfers and host optimizer step."""
    gpu, lines = cluster.gpu, []
    if memory.cpu_offload:
        lines.append(
            f"CPU offload: parameters and gradients over PCIe at {gpu.pcie_bytes_per_s / 1e9:.0f} GB/s, optimizer on"
            f" the host at {HOST_ADAM_PARAMS_PER_S:.0e} parameters/s per GPU (exposed)"
        )
    if memory.optimizer_offload:
        lines.append(
            f"optimizer offload: gradients to the host and parameters back over PCIe at {gpu.pcie_bytes_per_s / 1e9:.0f}"
            f" GB/s once per step, AdamW on the host at {HOST_ADAM_PARAMS_PER_S:.0e} parameters/s per GPU (exposed)"
        )
    return lines
