"""GPU speed levers: ``torch.compile`` per decoder layer, float8 linears (torchao) and async tensor parallelism.

Each decoder layer is compiled on its own, as torchtitan's ``apply_compile`` does: after tensor parallelism and
activation checkpointing (so the compiled graph holds the DTensor collectives and the checkpointed region) and
before FSDP2 (whose hooks stay outside the graph, on the layer module). One compiled graph per layer kind; every
layer of a kind reuses it. ``dynamic=False``: a new sequence length recompiles, as torchtitan's fixed-length batches
never do.

float8 swaps the ``nn.Linear`` layers of the decoder for torchao's ``Float8Linear`` (tensorwise scaling; FSDP2
all-gathers their weights in float8) before any other step; it needs a GPU of compute capability 8.9 or newer.
Async TP turns on inductor's micro-pipelining of the TP collectives with the matmuls and symmetric memory on the
TP group; it needs NCCL. Both are refused on CPU, before anything is applied.

On torch's fake process group (:func:`simulated`: the planner's dry run, a GPU world simulated on CPU under fake
tensors, where no kernel runs) nothing is refused for the device, float8 is applied as on a GPU (it changes the
tensors a step holds: FSDP2 gathers the weights in float8, 1 byte instead of 2, and the linears save float8 copies
of their inputs for backward), and compile and async TP are left out: they change the kernels and so the step
time (:mod:`lightning_plugins.planner.timing`), and compiling real-size layers under fake tensors would cost the
dry run minutes. Inductor's fusions can also save fewer activations than eager does: the dry run counts eager's.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions

__all__ = ["apply_compile", "apply_float8", "check_compile", "check_device", "enable_async_tp", "simulated"]

#: Compute capability float8 matmuls (``torch._scaled_mm``) need.
FLOAT8_CAPABILITY = (8, 9)


def simulated() -> bool:
    """Whether this process runs on torch's fake process group (the planner's dry run): a GPU world simulated, no
    device to refuse a lever for and no kernel to compile. A real run on CPU is on gloo, and is refused as such."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def check_compile(layout: ParallelLayout, options: ParallelOptions, memory: MemoryOptions) -> None:
    """Refuse the layouts the speed levers do not compose with (no weights, no collective needed).

    Raises:
        OptionsError: ``compile`` (and so ``float8``) with pipeline, context or expert parallelism, with TP and
            activation checkpointing, or with activation offload; ``async_tp`` without TP.
    """
    if options.compile:
        for size, what, why in (
            ("pp_size", "pipeline parallelism", "its stages run decoder layers inside torch's schedule"),
            ("cp_size", "context parallelism", "its attention is a custom autograd function with collectives"),
            ("ep_size", "expert parallelism", "its all-to-all has data-dependent split sizes"),
        ):
            if getattr(layout, size) > 1:
                # float8 needs compile (its casts are fused by inductor): refused with it, named, never dropped.
                levers, off = "compile=True is", "compile=False"
                if options.float8:
                    levers, off = "compile=True and float8=True are", "compile=False and float8=False"
                raise OptionsError(
                    f"{levers} not supported with {what} ({size}={getattr(layout, size)}): {why}, which"
                    f" this engine does not compile. Set {off}, or use tensor parallelism and FSDP2."
                )
    if options.compile and layout.tp_size > 1 and memory.activation_checkpointing != "none":
        raise OptionsError(
            f"compile=True with tp_size={layout.tp_size} and activation_checkpointing="
            f"{memory.activation_checkpointing!r} is not supported: torch's compiled backward of a checkpointed layer"
            " with DTensor activations fails (a DeviceMesh among the tensors saved for backward, torch 2.13). Set"
            " activation_checkpointing='none', or compile=False, or use FSDP2 without TP."
        )
    if options.compile and memory.activation_offload:
        raise OptionsError(
            "compile=True is not supported with activation_offload=True: its saved-tensor hooks move tensors to the"
            " host around each layer, which the compiled layer does not trace. Set one of them to False."
        )
    if options.async_tp and layout.tp_size == 1:
        raise OptionsError(
            "async_tp=True overlaps tensor-parallel collectives and needs tp_size > 1; set async_tp=False."
        )


def check_device(options: ParallelOptions, device_type: str, tp_size: int = 1) -> None:
    """Refuse float8 and async TP where they cannot run, before anything is applied.

    Raises:
        OptionsError: float8 or async TP on CPU (gloo), float8 on a GPU older than compute capability 8.9; compile
            with TP on CPU.
    """
    if device_type != "cuda":
        if options.compile and tp_size > 1:
            # Measured (torch 2.13, gloo): TP2 + SP compiled trains as one eager process does, but the compiled
            # DTensor graphs keep the gloo process groups (and their threads) alive after they are destroyed, which
            # lightning_plugins.parallel.teardown exists to prevent (a process aborting at exit).
            raise OptionsError(
                f"compile=True with tp_size={tp_size} is not supported on {device_type!r} (gloo): the compiled layers"
                " keep the process groups' threads alive after teardown. Set compile=False here, or run on CUDA GPUs."
            )
        for name, needs in (
            ("float8", "a CUDA GPU of compute capability 8.9 or newer (H100, H200, L4, RTX 4090)"),
            ("async_tp", "CUDA GPUs with NCCL and symmetric memory (H100-class, NVLink)"),
        ):
            if getattr(options, name):
                raise OptionsError(
                    f"{name}=True needs {needs}; this run is on {device_type!r}. Set {name}=False here (the"
                    " planner's dry run and step-time model still count it)."
                )
        return
    if options.float8 and torch.cuda.get_device_capability() < FLOAT8_CAPABILITY:
        raise OptionsError(
            f"float8=True needs a GPU of compute capability {FLOAT8_CAPABILITY} or newer (H100, L4, RTX 4090);"
            f" this one is {torch.cuda.get_device_name()} {torch.cuda.get_device_capability()}. Set float8=False."
        )


def apply_float8(model: nn.Module, fsdp: bool) -> None:
    """Swap the decoder's linear layers for torchao's float8 ones (not ``lm_head``, nor shapes not divisible by 16).

    Under peft only the base projections are converted (a LoRA layer's ``base_layer`` and the linears LoRA does not
    target), never the adapters' ``lora_A``/``lora_B``: their rank-sized matmuls gain nothing from float8 and lose
    accuracy (torchtune and torchtitan convert the base linears only). The frozen ones become
    :class:`~lightning_plugins.parallel.float8.FrozenFloat8Linear`, which saves no input for backward.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_plugins.parallel.float8 import freeze_float8_bases

    adapters = {
        id(adapter)
        for layer in model.modules()
        if isinstance(layer, BaseTunerLayer)
        for name in layer.adapter_layer_names
        if isinstance(getattr(layer, name, None), nn.ModuleDict)
        for adapter in getattr(layer, name).values()
    }

    def wanted(module: nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and id(module) not in adapters
            and "lm_head" not in fqn
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    convert_to_float8_training(model, config=config, module_filter_fn=wanted)
    freeze_float8_bases(model)  # a frozen base keeps no input for a weight gradient (+5.5 GiB at 8B LoRA, 4K tokens)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Micro-pipeline the TP collectives with the matmuls in the compiled layers (inductor + symmetric memory)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def apply_compile(layers: list[nn.Module]) -> None:
    """Compile each decoder layer in place (``Module.compile``: the module keeps its name, hooks and parameters).

    ``fullgraph=True``: a layer that does not compile whole fails at its first forward instead of running slowly in
    pieces. transformers' checkpointed layers call ``logger.warning_once`` (``use_cache`` dropped under checkpointing),
    which dynamo cannot trace: that notice is left out of the compiled graph.
    """
    torch._dynamo.config.ignore_logging_functions.add(logging.Logger.warning_once)
    for layer in layers:
        layer.compile(fullgraph=True, dynamic=False)
