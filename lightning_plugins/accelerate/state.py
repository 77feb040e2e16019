"""``save_state`` / ``load_state`` of the Accelerate door: one distributed (DCP) checkpoint directory.

What is kept: every prepared model and optimizer (sharded, each rank writing its own slices; optimizer
state flattened per parameter name, so pipeline stages with different parameter groups round-trip and a
checkpoint reshards to another layout), the gradients accumulated so far when saved inside an accumulation
window, schedulers, the gradient-accumulation step, each data loader's position, registered custom
objects, the gradient scaler, and every rank's random states.

The directory is written and published by the protocol both doors share
(:func:`lightning_plugins.checkpoint.dcp.save_sharded`): under ``<name>.partial``, renamed into place once complete,
so a crash never leaves a half-written checkpoint under the final name (see GROUND.md: DCP over an existing directory
is unsafe); with an :class:`~lightning_plugins.checkpoint.async_save.AsyncCheckpointer` the tensors are written in the
background and the rename waits for them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_plugins.checkpoint import dcp
from lightning_plugins.checkpoint.async_save import AsyncCheckpointer
from lightning_plugins.checkpoint.checks import reads_checkpoint
from lightning_plugins.checkpoint.export_info import save_export_info
from lightning_plugins.checkpoint.integrity import save_checksummed, verify_on_first_rank
from lightning_plugins.checkpoint.resume import load_rng
from lightning_plugins.checkpoint.safe_read import load_torch_file
from lightning_plugins.recipe.diff import record_recipe

#: Non-tensor state written once (identical on every rank).
STATE_FILE = "accelerator_state.pt"


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
    if saver is not None:
        saver.wait()  # the state below is taken after the save in flight (if any) has copied its own
    grads = [[name for name, p in model.named_parameters() if p.grad is not None] for model in accelerator._models]
    tensors = _tensor_state(accelerator, grads)
    every: list[Any] = [None] * dist.get_world_size()  # pipeline ranks hold different parameters: name them all
    dist.all_gather_object(every, grads)

    def write_files(partial: Path) -> None:
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

    dcp.save_sharded(tensors, path, rank=dist.get_rank(), barrier=dist.barrier, write_files=write_files, saver=saver)
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
    verify_on_first_rank(path, dist.get_rank() if dist.is_initialized() else 0, broadcast_from_first)
    if not (path / ".metadata").is_file() or not (path / STATE_FILE).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint written by ParallelAccelerator.save_state (no .metadata or"
            f" {STATE_FILE}); an interrupted save leaves only `{path.name}.partial`."
        )
    saved = load_torch_file(path / STATE_FILE)  # plain containers, numbers, strings and tensors: nothing else
    if len(saved["grads"]) != len(accelerator._models):
        raise ValueError(f"{path} holds {len(saved['grads'])} models but {len(accelerator._models)} are prepared now.")
    # This rank's part of the saved accumulated gradients (under pipeline parallelism: its stages' names).
    grads = [
        [name for name, _ in model.named_parameters() if name in set(names)]
        for model, names in zip(accelerator._models, saved["grads"])
    ]
    state = _tensor_state(accelerator, grads)
    dcp.load_tensors(state, path)
    for index, model in enumerate(accelerator._models):
        set_model_state_dict(model, state[_key("model", index)])
        for name, grad in state.get(_key("grads", index), {}).items():
            model.get_parameter(name).grad = grad
    for index, optimizer in enumerate(accelerator._optimizers):
        raw = _raw(optimizer)
        dcp.load_optimizer_state(_owner(accelerator, raw), raw, state[_key("optimizer", index)])
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
        state[_key("optimizer", index)] = dcp.optimizer_state(_owner(accelerator, raw), raw)
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


def broadcast_from_first(obj: Any) -> Any:
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


def numbered_states(root: Path) -> list[Path]:
    """Accelerate's automatically named states in ``root`` (``checkpoint_<i>``), oldest first."""
    found = [(m.group(1), p) for p in root.glob("checkpoint_*") if (m := re.fullmatch(r"checkpoint_(\d+)", p.name))]
    return [p for _, p in sorted(found, key=lambda item: int(item[0]))]


def next_state_dir(accelerator: Any) -> Path:
    """Accelerate's automatic naming: ``project_dir/checkpoints/checkpoint_<i>``, keeping ``total_limit``."""
    root = Path(accelerator.project_dir) / "checkpoints"
    limit = accelerator.project_configuration.total_limit
    if accelerator.is_main_process and limit is not None:
        existing = numbered_states(root)
        for old in existing[: max(0, len(existing) + 1 - limit)]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return root / f"checkpoint_{accelerator.save_iteration}"
