"""``save_state`` / ``load_state`` of the Accelerate door: one distributed (DCP) checkpoint directory.

What is kept: every prepared model and optimizer (sharded, each rank writing its own slices; optimizer
state flattened per parameter name, so pipeline stages with different parameter groups round-trip and a
checkpoint reshards to another layout), the gradients accumulated so far when saved inside an accumulation
window, schedulers, the gradient-accumulation step, each data loader's position, registered custom
objects, the gradient scaler, and every rank's random states.

The directory is written under ``<name>.partial`` and renamed into place once complete, so a crash never
leaves a half-written checkpoint under the final name (see GROUND.md: DCP over an existing directory is unsafe);
with an :class:`~lightning_plugins.checkpoint.async_save.AsyncCheckpointer` the tensors are written in the background and
the rename waits for them.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_plugins.checkpoint.async_save import AsyncCheckpointer
from lightning_plugins.checkpoint.checks import reads_checkpoint
from lightning_plugins.checkpoint.disk_space import check_room, writing_checkpoint
from lightning_plugins.checkpoint.export_info import save_export_info
from lightning_plugins.checkpoint.integrity import ChecksummedWriter, save_checksummed, verify_on_first_rank
from lightning_plugins.parallel import reduce_partial_state
from lightning_plugins.recipe.diff import record_recipe
from lightning_plugins.checkpoint.resume import load_rng, publish, save_rng

#: Non-tensor state written once (identical on every rank).
STATE_FILE = "accelerator_state.pt"
# One entry per parameter name: pipeline ranks hold different parameter groups (see the Lightning door).
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def save_training_state(accelerator: Any, path: str | Path, saver: AsyncCheckpointer | None = None) -> Path:
    """Write ``accelerator``'s prepared objects to the checkpoint directory ``path`` (collective).

    Args:
        accelerator: A :class:`~lightning_plugins.accelerate.ParallelAccelerator` after ``prepare``.
        path: The checkpoint directory; replaced if it exists.
        saver: Write the sharded tensors in the background with it (the rest, this step's state, is written
            now) and move the checkpoint into place once they are complete; ``None``: write everything now.

    Returns:
        ``path`` as a ``Path``.
    """
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    rank = dist.get_rank()
    if saver is not None:
        saver.wait()  # never two saves in flight (and the previous one's .partial is not removed under it)
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    grads = [[name for name, p in model.named_parameters() if p.grad is not None] for model in accelerator._models]
    tensors = _tensor_state(accelerator, grads)
    needed = check_room(partial, tensors)  # a disk without room refuses it on every rank, before any write
    with writing_checkpoint(partial, needed):  # a write failing for lack of room: named, and .partial removed
        if saver is None:
            dcp.save(tensors, storage_writer=ChecksummedWriter(partial))
        else:
            partial.mkdir(parents=True, exist_ok=True)
        every = [None] * dist.get_world_size()  # pipeline ranks hold different parameters: name them all
        dist.all_gather_object(every, grads)
        save_rng(partial, rank)
        if rank == 0:
            save_checksummed(
                {
                    "step": accelerator.step,
                    "grads": [sorted(set().union(*names)) for names in zip(*every)],
                    "schedulers": [scheduler.state_dict() for scheduler in accelerator._schedulers],
                    "dataloaders": [loader.position() for loader in accelerator._dataloaders],
                    "custom": [obj.state_dict() for obj in accelerator._custom_objects],
                    "scaler": None if accelerator.scaler is None else accelerator.scaler.state_dict(),
                },
                partial / STATE_FILE,
            )
            if accelerator._models:  # what `lightning-plugins export` needs besides the weights
                save_export_info(partial, accelerator._models[0], _key("model", 0), accelerator.load_from)
            if getattr(accelerator, "recipe_record", None) is not None:
                record_recipe(partial, accelerator.recipe_record)
        if saver is not None:  # everything but the tensors is on disk: publishing waits for them alone
            saver.save(tensors, partial, (lambda: publish(partial, path)) if rank == 0 else None, needed)
            return path
        dist.barrier()
        if rank == 0:
            publish(partial, path)
        dist.barrier()
        return path


@reads_checkpoint  # a corrupted checkpoint, or one of another model, gets an error naming it and the fix
def load_training_state(accelerator: Any, path: str | Path) -> None:
    """Restore ``accelerator``'s prepared objects from a directory written by :func:`save_training_state`.

    The layout may differ from the one that saved (DCP reshards model and optimizer); random states are
    restored from this rank's file (rank 0's when the saving world was smaller).

    Raises:
        FileNotFoundError: when ``path`` is not a complete checkpoint directory.
        ValueError: when the prepared objects do not match the saved ones in number.
    """
    path = Path(path)
    # Its files against its checksums, before any is read (rank 0 reads them; every rank stops on what it found).
    verify_on_first_rank(path, dist.get_rank() if dist.is_initialized() else 0, _broadcast)
    if not (path / ".metadata").is_file() or not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint written by ParallelAccelerator.save_state (no .metadata or"
            f" {STATE_FILE}); an interrupted save leaves only `{path.name}.partial`."
        )
    saved = torch.load(path / STATE_FILE, weights_only=True)  # plain containers, numbers, strings and tensors
    if len(saved["grads"]) != len(accelerator._models):
        raise ValueError(f"{path} holds {len(saved['grads'])} models but {len(accelerator._models)} are prepared now.")
    # This rank's part of the saved accumulated gradients (under pipeline parallelism: its stages' names).
    grads = [
        [name for name, _ in model.named_parameters() if name in set(names)]
        for model, names in zip(accelerator._models, saved["grads"])
    ]
    state = _tensor_state(accelerator, grads)
    dcp.load(state, checkpoint_id=path)
    for index, model in enumerate(accelerator._models):
        set_model_state_dict(model, state[_key("model", index)])
        for name, grad in state.get(_key("grads", index), {}).items():
            model.get_parameter(name).grad = grad
    for index, optimizer in enumerate(accelerator._optimizers):
        raw = _raw(optimizer)
        set_optimizer_state_dict(_owner(accelerator, raw), raw, state[_key("optimizer", index)], options=_FLAT)
    for what, objects in (
        ("schedulers", accelerator._schedulers),
        ("dataloaders", accelerator._dataloaders),
        ("custom", accelerator._custom_objects),
    ):
        if len(saved[what]) != len(objects):
            raise ValueError(
                f"{path} holds {len(saved[what])} {what} but {len(objects)} are prepared/registered now: prepare the"
                " same objects (in the same order) as the run that saved it."
            )
    for scheduler, scheduler_state in zip(accelerator._schedulers, saved["schedulers"]):
        scheduler.load_state_dict(scheduler_state)
    for loader, position in zip(accelerator._dataloaders, saved["dataloaders"]):
        loader.resume_from(position)
    for obj, obj_state in zip(accelerator._custom_objects, saved["custom"]):
        obj.load_state_dict(obj_state)
    if accelerator.scaler is not None and saved["scaler"] is not None:
        accelerator.scaler.load_state_dict(saved["scaler"])
    accelerator.step = saved["step"]
    load_rng(path, dist.get_rank())


def _tensor_state(accelerator: Any, grads: list[list[str]]) -> dict[str, Any]:
    """What DCP writes and reads: models, optimizers, and the accumulated gradients named in ``grads`` per model."""
    state: dict[str, Any] = {}
    for index, (model, names) in enumerate(zip(accelerator._models, grads)):
        state[_key("model", index)] = get_model_state_dict(model)
        if names:
            params = dict(model.named_parameters())
            state[_key("grads", index)] = {name: _saveable_grad(params[name]) for name in names}
    for index, optimizer in enumerate(accelerator._optimizers):
        raw = _raw(optimizer)
        optimizer_state = get_optimizer_state_dict(_owner(accelerator, raw), raw, options=_FLAT)
        state[_key("optimizer", index)] = reduce_partial_state(optimizer_state)
    return state


def _saveable_grad(param: Tensor) -> Tensor:
    """The gradient laid out like its parameter (a pending sum over tensor-parallel ranks is reduced now:
    DCP stores no partial DTensors), or zeros of that layout to load into."""
    grad = param.grad
    if grad is None:
        return torch.zeros_like(param.detach())
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself in one process)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _key(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"


def _raw(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)


def _owner(accelerator: Any, optimizer: torch.optim.Optimizer) -> nn.Module:
    """The prepared model whose parameters ``optimizer`` updates."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in accelerator._models:
        if any(id(p) in held for p in model.parameters()):
            return model
    raise ValueError(
        f"{type(accelerator).__name__}.save_state/load_state: an optimizer updates no parameter of a prepared model;"
        " prepare the model and its optimizer together (accelerator.prepare(model, optimizer, ...))."
    )
