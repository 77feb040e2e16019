"""What the engine adds to a model that the user's own code split by hand.

Lightning's TP guide parallelizes the model in the LightningModule's ``configure_model``
(``parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)``), and its FSDP2 + TP example then
shards the data ranks itself. A model split that way is kept as it is (its tensor parallelism is the user's plan);
what the layout and the memory levers ask for on top is added here in the engine's order (activation checkpointing
-> compile -> FSDP2 per decoder layer and the root, on the data mesh of the same device mesh, as Lightning's example
does after its TP), with the token-exact loss of :mod:`~lightning_plugins.parallel.loss`. What cannot be added to a
split the engine did not make is refused by name before anything is applied: pipeline stages (they drop layers),
context parallelism (it rewires attention), expert parallelism (it moves the experts) and float8 (it must replace
the linears before they are split).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.api import SETTINGS_ATTR
from lightning_plugins.parallel.memory.activation import apply_activation_checkpointing
from lightning_plugins.parallel.memory.chunked_loss import install_chunked_loss
from lightning_plugins.parallel.compile import apply_compile, simulated
from lightning_plugins.parallel.families import decoder_layers, family_for, final_norm
from lightning_plugins.parallel.fsdp import apply_fsdp, mixed_precision_policy, offload_policy
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.loss import ParallelCausalLMLoss
from lightning_plugins.parallel.mesh import attach_mesh, data_mesh, fsdp_mesh, mesh_of
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel.plan import ParallelPlan, layout_of_mesh, plan_of
from lightning_plugins.parallel.save_pretrained import install_save_pretrained

__all__ = ["check_split_by_hand", "complete_split_by_hand", "split_by_hand"]


def split_by_hand(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters that the engine did not make (the user's own ``parallelize_module``
    / ``fully_shard``)."""
    return mesh_of(model) is None and any(isinstance(p, DTensor) for p in model.parameters())


def check_split_by_hand(
    owner: str, model: nn.Module, layout: ParallelLayout, options: ParallelOptions | None = None
) -> None:
    """Refuse what cannot be added to a model split by hand (no collective runs).

    Raises:
        LayoutError: naming each dimension or setting that cannot be added, and the fix.
    """
    refused = {name: getattr(layout, name) for name in ("pp_size", "cp_size", "ep_size") if getattr(layout, name) > 1}
    if options is not None and options.float8:
        refused["float8"] = True
    if refused:
        shown = ", ".join(f"{name}={value}" for name, value in refused.items())
        raise LayoutError(
            f"{owner}: the LightningModule's configure_model parallelized its {type(model).__name__} itself (its"
            f" parameters are already DTensors), and {owner} cannot add {shown} to a model parallelized by hand"
            " (FSDP2 over the data ranks and activation checkpointing it adds). Either let the strategy parallelize"
            " it (drop parallelize_module/fully_shard from configure_model; the layout's sizes then apply every"
            " dimension), or keep pp_size, cp_size and ep_size at 1 and float8 off."
        )
    data = layout.dp_replicate_size * layout.dp_shard_size
    meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in model.parameters() if isinstance(p, DTensor)}
    if any(len(ranks) > layout.tp_size * data for ranks in meshes):
        raise LayoutError(
            f"{owner}: the model's DTensor parameters span more ranks than tensor x data parallelism"
            f" (tp_size={layout.tp_size}); parallelize it over self.device_mesh['tensor_parallel']."
        )


def complete_split_by_hand(
    model: nn.Module,
    mesh: ParallelPlan | DeviceMesh,
    options: ParallelOptions | None = None,
    memory: MemoryOptions | None = None,
) -> nn.Module:
    """Add to ``model`` (split by hand over ``mesh``'s tensor-parallel ranks) what the layout and levers ask for.

    Activation checkpointing (and offload) of the decoder layers, ``torch.compile`` per layer, FSDP2 over the data
    ranks (unless the user's code sharded the model itself: kept as it is), the loss averaged over valid tokens across
    the data ranks (chunked when the head is not split), and ``mesh`` recorded as the model's, so that a later entry
    point reuses it. The engine's module rewrites made before tensor parallelism (efficient norms and MLPs, tiled
    MLPs) are left out: the user's plan split those modules already.

    Args:
        model: A transformers causal LM whose parameters the user's code made DTensors on ``mesh``'s views.
        mesh: The door's plan (:func:`~lightning_plugins.parallel.plan.resolve`), or its mesh (the plan that built it,
            or :meth:`~lightning_plugins.ParallelLayout.build_mesh`'s layout, is found from it).
        options: How each dimension is applied (only ``compile`` acts here; ``float8`` is refused); ``None``: the
            plan's, else the defaults.
        memory: The memory levers; ``None``: the plan's, else the defaults.

    Returns:
        The same model.
    """
    plan = mesh if isinstance(mesh, ParallelPlan) else plan_of(mesh)
    if isinstance(mesh, ParallelPlan):
        mesh = mesh.mesh()
    layout = plan.layout if plan is not None else layout_of_mesh(mesh)
    options = options or (plan.options if plan is not None else ParallelOptions())
    memory = memory or (plan.memory if plan is not None else MemoryOptions())
    check_split_by_hand("parallelize", model, layout, options)
    family = family_for(model, tensor_parallel=False)
    layers = decoder_layers(model, family)
    apply_activation_checkpointing(
        layers, memory.activation_checkpointing, memory.every_n_layers, offload=memory.activation_offload
    )
    if options.compile and not simulated():
        apply_compile(layers)
    head = model.get_output_embeddings()
    # A head the user split keeps its logits as the plan gives them (the chunked loss would assume the engine's split).
    split_head = head is not None and isinstance(getattr(head, "weight", None), DTensor)
    fsdp = fsdp_mesh(mesh)
    if fsdp is not None and not any(isinstance(m, FSDPModule) for m in model.modules()):
        apply_fsdp(
            model,
            layers,
            fsdp,
            mp_policy=mixed_precision_policy(memory.param_dtype, memory.reduce_dtype),
            offload=offload_policy(memory.cpu_offload, mesh.device_type),
            reshard_after_forward=memory.reshard_after_forward,
            embedding=model.get_input_embeddings(),
            head=(final_norm(model, family), model.get_output_embeddings()),
        )
    chunk = None if split_head else memory.loss_chunk_tokens
    model.loss_function = ParallelCausalLMLoss(data_mesh(mesh), install_chunked_loss(model, chunk, True))
    install_save_pretrained(model)
    attach_mesh(model, mesh)
    setattr(model, SETTINGS_ATTR, (options, memory))  # a later entry point must ask for the same settings
    return model
