"""Tensor parallelism (with sequence and loss parallelism) for transformers decoders, on DTensor.

Layout of one decoder layer under sequence parallelism (``sp``)::

    residual stream: DTensor Shard(1) (sequence-sharded)
    norm:            SequenceParallel, stays Shard(1)
    attention / MLP: input all-gathered to Replicate once (the region hook), column-parallel
                     q/k/v/gate/up, row-parallel o/down whose output is reduce-scattered to Shard(1)

Without ``sp`` the residual stream is a replicated plain tensor, norms hold replicated DTensor weights,
and each region's input is marked Replicate once so its backward all-reduces one gradient, not one per
column-parallel projection. Every parameter ends up a DTensor on the tensor-parallel mesh, so FSDP2
composes on a 2-D mesh and gradient norms see one mesh.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_plugins.models import ModelFamily, decoder_layers

# The dimension of attention heads in the [batch, seq, heads, head_dim] tensors that q/k norms see.
_HEAD_DIM = 2


def apply_tensor_parallel(
    model: nn.Module,
    family: ModelFamily,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
) -> None:
    """Split ``model`` in place over ``tp_mesh``.

    Args:
        model: A transformers causal LM (``get_input_embeddings`` / ``get_output_embeddings``).
        family: Its module names (see :mod:`lightning_plugins.models`).
        tp_mesh: The 1-D tensor-parallel mesh.
        sequence_parallel: Shard norms and the residual stream along the sequence between regions.
        loss_parallel: Keep the logits vocab-sharded (``Shard(-1)``); the loss is then computed on the
            shards by :mod:`lightning_plugins.parallel.loss` and the full logits are never gathered.
    """
    sp = sequence_parallel and family.sequence_parallel
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = lm_head is not None and lm_head.weight is embed.weight

    # Vocab-parallel embedding: each rank holds a slice of the rows; the partial sums are
    # reduce-scattered along the sequence (sp) or all-reduced.
    parallelize_module(
        embed,
        tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp),
    )
    for layer in decoder_layers(model, family):
        _parallelize_layer(layer, family, tp_mesh, sp)
    if family.final_norm:
        _parallelize_norm(model.get_submodule(family.final_norm), tp_mesh, sp)
    if lm_head is not None:
        parallelize_module(
            lm_head,
            tp_mesh,
            ColwiseParallel(
                input_layouts=Shard(1) if sp else Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        )
        if tied:
            # Both are Shard(0) over the vocabulary rows, so one DTensor serves both.
            lm_head.weight = embed.weight
    replicate_remaining_params(model, tp_mesh)


def _parallelize_layer(layer: nn.Module, family: ModelFamily, tp_mesh: DeviceMesh, sp: bool) -> None:
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in family.colwise}
    for name in family.rowwise:
        plan[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()
    for name, style in family.extra_styles.items():
        plan[name] = ColwiseParallel(output_layouts=Replicate()) if style == "colwise_gather_output" else RowwiseParallel(
            input_layouts=Replicate()
        )
    for name in family.head_norms:
        # q/k norms normalise each head's vector; their input is split by heads on this rank.
        plan[name] = SequenceParallel(sequence_dim=_HEAD_DIM, use_local_output=True)
    parallelize_module(layer, tp_mesh, plan)
    for name in family.layer_norms:
        _parallelize_norm(layer.get_submodule(name), tp_mesh, sp)
    for name in family.tp_regions:
        layer.get_submodule(name).register_forward_pre_hook(_RegionInput(tp_mesh), with_kwargs=True)


def _parallelize_norm(norm: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    if sp:
        parallelize_module(norm, tp_mesh, SequenceParallel())
    else:
        _replicate_module(norm, tp_mesh)


class _RegionInput:
    """Forward pre-hook: make a region's input one replicated DTensor.

    Under sp this all-gathers the sequence (and reduce-scatters in backward); otherwise it marks the
    replicated activation, so the partial input-gradients of all column-parallel projections are summed
    locally and all-reduced once.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if args:
            return (self._replicate(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = self._replicate(kwargs["hidden_states"])
        return args, kwargs

    def _replicate(self, x: Any) -> Any:
        if isinstance(x, DTensor):
            return x.redistribute(placements=[Replicate()])
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)


def _replicate_module(module: nn.Module, mesh: DeviceMesh) -> None:
    """Hold ``module``'s own parameters as replicated DTensors; plain tensors in and out."""

    def partition(_name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        for key, param in list(mod.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                mod.register_parameter(
                    key, nn.Parameter(distribute_tensor(param, device_mesh, [Replicate()]), param.requires_grad)
                )

    def inputs(_mod: nn.Module, args: tuple, device_mesh: DeviceMesh) -> tuple:
        return tuple(
            a.redistribute(placements=[Replicate()])
            if isinstance(a, DTensor)
            else DTensor.from_local(a, device_mesh, [Replicate()], run_check=False)
            if hasattr(a, "dim")
            else a
            for a in args
        )

    def outputs(_mod: nn.Module, out: Any, _device_mesh: DeviceMesh) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, partition, inputs, outputs)  # type: ignore[arg-type]


def replicate_remaining_params(model: nn.Module, mesh: DeviceMesh) -> None:
    """Give every module that still owns plain parameters replicated DTensor weights."""
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            _replicate_module(module, mesh)
