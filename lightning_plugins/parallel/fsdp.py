"""FSDP2 over the data dimensions: per-layer ``fully_shard``, HSDP, mixed precision and CPU offload.

Units (as torchtitan and torchtune's ``custom_sharded_layers``): each decoder layer; the embedding; the final norm
with the head; then the root, which FSDP2 never reshards after forward, so whatever it holds stays gathered from
the start of forward to the end of backward on every data rank (2 x 1.96 GiB for Llama-3.1-70B's embedding and
head in bf16). Alone, the embedding is resharded after its forward and not gathered again: backward reads none of
its weights (frozen, as under LoRA, or a lookup table, whose gradient only scatters rows). The norm and head,
needed again at once by backward, stay gathered until their post-backward reshard; every layer, the last one too,
is resharded after forward (ZeRO-3) and gathered again in backward. A tied embedding and head (one weight) stay one
unit: the root, as before.

In forward FSDP2 keeps each unit's flat all-gather output (its parameters' copies before the per-parameter copy-out)
alive until the *next* unit has gathered and copied out its own: at the head's gather that is three buffers at once,
the last layer's output, the head's output and the head's parameters (1.5 + 3.9 + 3.9 GiB for Llama-3.1-405B under
QLoRA on 8 ranks, the step's peak). :func:`_free_copied_out_all_gather` frees each unit's output as soon as it is
copied out, as FSDP2 does in backward, with the all-gather streams ordered after the copy-out as FSDP2 orders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.moe.experts import ExpertMeshes, expert_modules
from lightning_plugins.parallel.dtypes import MIXED_PRECISION_DTYPES


def mixed_precision_policy(param_dtype: str | torch.dtype | None, reduce_dtype: str | torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy from dtype names (``"bf16"``, ``"fp32"``) or dtypes; ``None`` keeps the parameters' dtype."""

    def as_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
        if value is None or isinstance(value, torch.dtype):
            return value
        if value not in MIXED_PRECISION_DTYPES:
            names = sorted(MIXED_PRECISION_DTYPES)
            raise LayoutError(f"Unknown dtype {value!r} for mixed precision; use one of {names}.")
        return MIXED_PRECISION_DTYPES[value]

    return MixedPrecisionPolicy(param_dtype=as_dtype(param_dtype), reduce_dtype=as_dtype(reduce_dtype))


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """``CPUOffloadPolicy`` when asked; pinned memory needs an accelerator, so CPU runs skip pinning."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


def apply_fsdp(
    model: nn.Module,
    layers: nn.ModuleList,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
    reshard_after_forward: bool = True,
    experts: ExpertMeshes | None = None,
    embedding: nn.Module | None = None,
    head: Sequence[nn.Module | None] = (),
    vision: Sequence[nn.Module] = (),
) -> None:
    """Shard each decoder layer, the embedding, the final norm with the head, then the root (see the module doc).

    Args:
        model: The (possibly tensor-parallel) model.
        layers: Its decoder layers, each its own all-gather/reduce-scatter unit.
        mesh: 1-D (FSDP) or 2-D ``(dp_replicate, dp_shard_cp)`` (HSDP) data mesh.
        mp_policy: Mixed precision (``None``: compute and reduce in the parameters' dtype).
        offload: ``CPUOffloadPolicy`` to keep sharded parameters and optimizer state on the CPU.
        reshard_after_forward: Free gathered parameters after forward (ZeRO-3); ``False`` keeps
            them until backward (ZeRO-2-like, more memory, fewer all-gathers).
        experts: Under expert parallelism, the expert meshes: each experts module is its own unit, sharded over
            ``experts.fsdp`` (the data ranks that do not split the experts). An expert's gradient sums the tokens that
            the ``ep`` ranks sent it, so it is divided by all the data ranks, as the dense weights' are.
        embedding: The input embedding ``model`` holds (``None``: none, e.g. a later pipeline stage).
        head: The final norm and the output head ``model`` holds (``None`` entries are skipped), one unit.
        vision: An image-text model's vision blocks and projector modules, each its own unit
            (:meth:`~lightning_plugins.parallel.image_text.ImageTextParts.vision_units`); the rest of the vision tower
            (its patch embedding) stays in the root.
    """
    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(), "offload_policy": offload or OffloadPolicy()}
    for unit in vision:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    for layer in layers:
        if experts is not None:
            for _, module in expert_modules(layer):
                fully_shard(module, **{**kwargs, "mesh": experts.fsdp}, reshard_after_forward=reshard_after_forward)
                module.set_gradient_divide_factor(float(experts.data_ranks))
                # gloo has no pre-scaled sum: divide around a plain sum instead (torch 2.13 divides twice when the
                # shard group is one rank, so only where it is larger).
                shards = experts.fsdp.size(experts.fsdp.ndim - 1)
                module.set_force_sum_reduction_for_comms(experts.fsdp.device_type == "cpu" and shards > 1)
        # The last layer too: the head's backward runs first, while FSDP2 gathers the layer again (kept gathered,
        # it would add a layer to the step's peak, at the end of forward when the head is gathered).
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    head = [module for module in head if module is not None]
    if not _tied(embedding, head):
        if embedding is not None:
            fully_shard(embedding, reshard_after_forward=reshard_after_forward, **kwargs)
            # FSDP2 prefetches it in backward as the last unit to run; a lookup's gradient needs no weight values.
            embedding.set_unshard_in_backward(not _backward_needs_no_weights(embedding))
        if head:
            fully_shard(head if len(head) > 1 else head[0], reshard_after_forward=False, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    units = {id(state): state for state in (fully_shard.state(m) for m in model.modules() if isinstance(m, FSDPModule))}
    for state in units.values():
        # After FSDP2's own pre-forward hook (the unit's gather and copy-out); each of a grouped unit's modules
        # (the norm and the head) runs it: the first frees, the others find nothing left.
        for member in state._modules:
            member.register_forward_pre_hook(_free_copied_out_all_gather)


@torch.compiler.disable  # bookkeeping of FSDP2's communication state, as FSDP2's own hooks (a compiled layer runs it)
def _free_copied_out_all_gather(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Free the flat all-gather output FSDP2 keeps after a unit's forward copy-out (see the module doc).

    FSDP2 keeps it so that the next all-gather need not wait for this copy-out; the next all-gather is issued after
    this unit's forward, which runs after the copy-out, so ordering the all-gather streams after it (the event FSDP2
    records for that, as its root's post-forward does) delays nothing a step does.
    """
    comm = fully_shard.state(module)._comm_ctx
    kept = comm.all_gather_state
    if kept is None:
        return
    comm.all_gather_state = None
    if kept.event is not None:
        comm.all_gather_copy_in_stream.wait_event(kept.event)
        comm.all_gather_stream.wait_event(kept.event)


def _backward_needs_no_weights(embedding: nn.Module) -> bool:
    """Whether backward reads none of ``embedding``'s parameters: all frozen (LoRA), or a plain lookup table (an
    ``nn.Embedding`` subclass holding its weight only, whose gradient is the output gradient scattered to rows)."""
    params = list(embedding.parameters())
    if not any(param.requires_grad for param in params):
        return True
    return isinstance(embedding, nn.Embedding) and not list(embedding.children()) and params == [embedding.weight]


def _tied(embedding: nn.Module | None, head: list[nn.Module]) -> bool:
    """Whether the embedding and a head module share their weight (``tie_word_embeddings``): one unit, the root."""
    weight = getattr(embedding, "weight", None)
    return weight is not None and any(getattr(module, "weight", None) is weight for module in head)


def reshard_gathered(model: nn.Module) -> None:
    """Free what FSDP2 still holds gathered after a forward with no backward: a root keeps its parameters after
    forward for a backward that never comes (a DPO reference pass, forward-only pipeline micro-batches)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
