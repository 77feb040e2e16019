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

peft LoRA layers at the split projections are split with their base layer (the last section below): the
base layer as planned, one adapter half like it and the other replicated.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_plugins.parallel.moe.experts import OnLocalParameters, TokenLocalBlock, moe_block_name
from lightning_plugins.parallel.families import ModelFamily, decoder_layers
from lightning_plugins.parallel.linear_attention import HeadSplitLinearAttention
from lightning_plugins.parallel.memory.regather import RegatherInBackward
from lightning_plugins.parallel.tensor_checks import check_adapters, submodule_or_none
from lightning_plugins.parallel.vocab_embedding import keep_embedding_grad_sharded

# The dimension of attention heads in the [batch, seq, heads, head_dim] tensors that q/k norms see.
_HEAD_DIM = 2


def apply_tensor_parallel(
    model: nn.Module,
    family: ModelFamily,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    regather: bool = False,
) -> None:
    """Split ``model`` in place over ``tp_mesh``.

    Args:
        model: A transformers causal LM (``get_input_embeddings`` / ``get_output_embeddings``).
        family: Its module names (see :mod:`lightning_plugins.parallel.families`).
        tp_mesh: The 1-D tensor-parallel mesh.
        sequence_parallel: Shard norms and the residual stream along the sequence between regions.
        loss_parallel: Keep the logits vocab-sharded (``Shard(-1)``); the loss is then computed on the
            shards by :mod:`lightning_plugins.parallel.loss` and the full logits are never gathered.
        regather: Under sequence parallelism, keep each region's sequence shard for backward and all-gather it
            again there, instead of the gathered input (:class:`lightning_plugins.parallel.memory.regather.RegatherInBackward`).
    """
    sp = sequence_parallel and family.sequence_parallel
    check_adapters(model, family)
    # torch's SequenceParallel re-creates the norms' parameters as trainable: a frozen base must stay frozen.
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = lm_head is not None and lm_head.weight is embed.weight

    # Vocab-parallel embedding: each rank holds a slice of the rows; the partial sums are
    # reduce-scattered along the sequence (sp) or all-reduced.
    parallelize_module(
        embed,
        tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp),
    )
    keep_embedding_grad_sharded(embed)  # else its gradient comes back whole on every rank
    dropouts = [_parallelize_layer(layer, family, tp_mesh, sp, sp and regather) for layer in decoder_layers(model, family)]
    if any(dropouts):
        _sync_rng(tp_mesh)
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
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def _parallelize_layer(layer: nn.Module, family: ModelFamily, tp_mesh: DeviceMesh, sp: bool, regather: bool) -> bool:
    """Split one decoder layer; return whether it has LoRA dropout (whose RNG the tp ranks must share).

    A mixture-of-experts block is not split: it runs on this rank's tokens (:class:`TokenLocalBlock`).
    """
    block = moe_block_name(layer)
    in_block = (lambda name: name == block or name.startswith(f"{block}.")) if block is not None else (lambda _: False)

    def inside(name: str) -> bool:  # not split here: in the token-local block, or absent (a layer of another type)
        return in_block(name) or submodule_or_none(layer, name) is None

    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in family.colwise if not inside(name)}
    for name in family.rowwise:
        if not inside(name):
            plan[name] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()
    for name, style in family.extra_styles.items():
        if not inside(name):
            # A fused projection (Phi-3's qkv_proj, gate_up_proj) or one followed by a norm over all heads
            # (OLMo 2's q_norm): its whole output is gathered; the row-parallel one after it splits its input.
            if style == "colwise_gather_output":
                plan[name] = ColwiseParallel(output_layouts=Replicate())
            elif sp:
                plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
            else:
                plan[name] = RowwiseParallel(input_layouts=Replicate())
    for name in family.head_norms:
        if not inside(name):
            # q/k norms normalise each head's vector; their input is split by heads on this rank.
            plan[name] = SequenceParallel(sequence_dim=_HEAD_DIM, use_local_output=True)
    plan, dropout = _split_adapters(layer, plan, tp_mesh)
    for name in family.linear_attention:
        if not inside(name):
            dropout |= _split_linear_attention(layer.get_submodule(name), tp_mesh, sp)
    parallelize_module(layer, tp_mesh, plan)
    for name in family.layer_norms:
        _parallelize_norm(layer.get_submodule(name), tp_mesh, sp)
    for name in family.head_params:
        _split_by_heads(layer, name, tp_mesh)
    for name in family.tp_regions:
        if not inside(name):
            region = layer.get_submodule(name)
            keep_shard = RegatherInBackward(region) if regather else None
            region.register_forward_pre_hook(_RegionInput(tp_mesh, keep_shard), with_kwargs=True)
    if block is not None:
        TokenLocalBlock(tp_mesh).install(layer.get_submodule(block))
    return dropout


def _split_linear_attention(module: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> bool:
    """Split a Gated DeltaNet by heads (:mod:`lightning_plugins.parallel.linear_attention`); return whether it has
    LoRA dropout, replaced by one process's masks (``out_proj``'s input is split by value heads)."""
    HeadSplitLinearAttention(module, tp_mesh, sequence_parallel=sp).install()
    dropout = False
    if "peft" not in sys.modules:
        return dropout
    from peft.tuners.lora import LoraLayer

    for name, sub in module.named_modules():
        if not isinstance(sub, LoraLayer):
            continue
        for adapter, drop in list(sub.lora_dropout.items()):
            if isinstance(drop, nn.Dropout) and drop.p > 0:
                features = sub.in_features if name == "out_proj" else None
                sub.lora_dropout[adapter] = TensorParallelDropout(drop.p, tp_mesh, features)
                dropout = True
    return dropout


def _split_by_heads(layer: nn.Module, name: str, tp_mesh: DeviceMesh) -> None:
    """Hold a per-head parameter (gpt-oss's attention sinks) as ``Shard(0)`` over tp, the heads this rank's
    column-parallel q/k/v give it; its module runs on the local slice (the gradient stays that slice's)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = layer.get_submodule(owner_name)
    param = owner.get_parameter(leaf)
    sharded = distribute_tensor(param.data, tp_mesh, [Shard(0)])
    owner.register_parameter(leaf, nn.Parameter(sharded, param.requires_grad))
    owner.forward = OnLocalParameters(owner, (leaf,))  # type: ignore[method-assign]


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

    def __init__(self, mesh: DeviceMesh, regather: RegatherInBackward | None = None) -> None:
        self.mesh, self.regather = mesh, regather

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if args:
            return (self._replicate(args[0]), *args[1:]), kwargs
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = self._replicate(kwargs["hidden_states"])
        return args, kwargs

    def _replicate(self, x: Any) -> Any:
        if isinstance(x, DTensor):
            gathered = x.redistribute(placements=[Replicate()])
            if self.regather is not None and x.placements != gathered.placements:
                self.regather.begin(x, gathered)
            return gathered
        return DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)


def _replicate_module(module: nn.Module, mesh: DeviceMesh, *, local_io: bool = True) -> None:
    """Hold ``module``'s own parameters as replicated DTensors; plain tensors in and out (DTensors with
    ``local_io=False``)."""

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

    def dtensor_inputs(_mod: nn.Module, args: tuple, _device_mesh: DeviceMesh) -> tuple:
        # A reduce-scattered activation can arrive as a strided view (uneven sequence shards), which a
        # linear layer cannot flatten: give it a contiguous local tensor.
        return tuple(
            DTensor.from_local(
                a.to_local().contiguous(),
                a.device_mesh,
                a.placements,
                run_check=False,
                shape=a.shape,
                stride=a.stride(),
            )
            if isinstance(a, DTensor)
            else a
            for a in args
        )

    if local_io:
        distribute_module(module, mesh, partition, inputs, outputs)  # type: ignore[arg-type]
    else:
        distribute_module(module, mesh, partition, dtensor_inputs)  # type: ignore[arg-type]


def replicate_remaining_params(model: nn.Module, mesh: DeviceMesh) -> None:
    """Give every module that still owns plain parameters replicated DTensor weights."""
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            _replicate_module(module, mesh)


# ------------------------------------------------------------------------------------------------------------
# peft LoRA adapters: each adapter half is split consistently with its base layer.
#
# Column-parallel base (output features split): ``lora_B`` is column-parallel like it and ``lora_A`` replicated,
# so the adapter's output is split like the base's; the backward all-reduce of ``lora_B``'s replicated input is
# the one that makes ``lora_A``'s gradient whole. Row-parallel base (input features split): ``lora_A`` is
# row-parallel like it (its partial sums reduced by the same collective as the base's, all-reduced or
# reduce-scattered along the sequence) and ``lora_B`` replicated. Only ``r``-wide activations are reduced for an
# adapter; no full-size one is gathered. peft keeps adapters in ``ModuleDict`` s keyed by adapter name, so each
# half is an ordinary module that ``parallelize_module`` can split.


def _split_adapters(
    layer: nn.Module, plan: dict[str, ParallelStyle], tp_mesh: DeviceMesh
) -> tuple[dict[str, ParallelStyle], bool]:
    """``plan`` with each entry naming a LoRA layer replaced by entries for its base layer and adapter halves.

    Returns:
        The plan, and whether an adapter dropout was replaced by a :class:`TensorParallelDropout`.
    """
    if "peft" not in sys.modules:
        return plan, False
    from peft.tuners.lora import LoraLayer

    split: dict[str, ParallelStyle] = {}
    has_dropout = False
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if not isinstance(module, LoraLayer):
            split[name] = style
            continue
        colwise = isinstance(style, ColwiseParallel)
        split[f"{name}.base_layer"] = style if colwise else _RowwiseBase.like(style)
        for adapter in module.lora_A:
            a, b = f"{name}.lora_A.{adapter}", f"{name}.lora_B.{adapter}"
            if colwise:
                split[a] = _ReplicatedAdapter(local_io=True)
                split[b] = ColwiseParallel(
                    output_layouts=style.output_layouts[0], use_local_output=style.use_local_output
                )
            else:
                split[a] = RowwiseParallel(
                    input_layouts=style.input_layouts[0],
                    output_layouts=style.output_layouts[0],
                    use_local_output=style.use_local_output,
                )
                # Under sequence parallelism lora_A's output is a sequence-sharded DTensor, and so is lora_B's.
                split[b] = _ReplicatedAdapter(local_io=style.use_local_output)
            dropout = module.lora_dropout[adapter]
            if isinstance(dropout, nn.Dropout) and dropout.p > 0:
                split_input = not colwise and isinstance(style.input_layouts[0], Shard)
                features = module.in_features if split_input else None
                module.lora_dropout[adapter] = TensorParallelDropout(dropout.p, tp_mesh, features)
                has_dropout = True
    return split, has_dropout


class _RowwiseBase(RowwiseParallel):
    """``RowwiseParallel`` whose output reduction is complete when the base layer returns.

    Recomputation under activation checkpointing stops after the last tensor backward needs, which in a
    LoRA layer is inside the adapter, after the base layer's (asynchronous) reduction was issued: a
    reduction nobody waits for would stay registered until the process exits.
    """

    @staticmethod
    def like(style: RowwiseParallel) -> _RowwiseBase:
        return _RowwiseBase(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        local = outputs.to_local() if isinstance(outputs, DTensor) else outputs
        if isinstance(local, AsyncCollectiveTensor):
            local.trigger_wait()
        return outputs


class _ReplicatedAdapter(ParallelStyle):
    """An adapter half every tensor-parallel rank holds whole, as replicated DTensor weights.

    ``local_io``: plain tensors in and out (a replicated activation); otherwise DTensors pass through as they
    are (a sequence-sharded activation under sequence parallelism stays sharded).
    """

    def __init__(self, *, local_io: bool) -> None:
        super().__init__()
        self.local_io = local_io

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # distribute_tensor(..., [Replicate()]) broadcasts from the first rank: every rank starts identical.
        _replicate_module(module, device_mesh, local_io=self.local_io)
        return module


class TensorParallelDropout(nn.Module):
    """LoRA dropout under tensor parallelism: one process's mask, whatever part of the activation a rank holds.

    Every tensor-parallel rank draws the mask of the whole activation from its default generator (the
    generators are made equal across the group when the model is split, and stay equal because the ranks
    run the same ops) and keeps its own slice. A replicated input thus gets the same mask on every rank,
    and a feature-split input (a row-parallel ``lora_A``'s) the slices of one mask. The draw is the one
    ``torch.nn.functional.dropout`` makes on CPU, so the masks are those one process would draw.

    Args:
        p: Drop probability.
        mesh: The tensor-parallel mesh.
        features: For an input split along its last dimension: the whole dimension's size; ``None`` for
            a replicated input.
    """

    def __init__(self, p: float, mesh: DeviceMesh, features: int | None = None) -> None:
        super().__init__()
        self.p, self.mesh, self.features = p, mesh, features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        local = x.to_local() if isinstance(x, DTensor) else x
        if isinstance(x, DTensor) and not all(isinstance(p, Replicate) for p in x.placements):
            raise RuntimeError(
                f"TensorParallelDropout expects a replicated or feature-split input, got placements {x.placements}."
            )
        shape = (*local.shape[:-1], self.features) if self.features is not None else local.shape
        noise = torch.empty(shape, dtype=local.dtype, device=local.device).bernoulli_(1 - self.p).div_(1 - self.p)
        if self.features is not None:
            noise = noise.chunk(self.mesh.size(), dim=-1)[self.mesh.get_local_rank()]  # DTensor's Shard(-1) split
        out = local * noise
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False) if isinstance(x, DTensor) else out

    def extra_repr(self) -> str:
        return f"p={self.p}, split_features={self.features}"


def _sync_rng(tp_mesh: DeviceMesh) -> None:
    """Give every tensor-parallel rank the first one's RNG state (CPU and, on GPUs, the current device's)."""
    group = tp_mesh.get_group()
    cuda = tp_mesh.device_type == "cuda"
    states = [torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None]
    dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group)
    torch.set_rng_state(states[0])
    if cuda:
        torch.cuda.set_rng_state(states[1])
