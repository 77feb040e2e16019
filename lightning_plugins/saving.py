"""Saving a parallelized model the way users already save: ``save_pretrained`` and a full ``state_dict``.

After :func:`lightning_plugins.parallelize` each rank holds shards (DTensors under TP, FSDP2 and CP) or only its
pipeline stages, so the library's own ``model.save_pretrained(out_dir)`` fails on the DTensors, or under
pipeline parallelism writes one stage's weights. ``parallelize`` therefore installs :func:`save_pretrained` on
the model it parallelized (the transformers model and the peft ``PeftModel`` around it): every rank calls it, as
the HF and Accelerate habit is, the trained tensors are gathered with the export machinery of
:mod:`lightning_plugins.checkpoint` (each DTensor by the ranks that share it, pipeline stages collected on rank
0), and the writing rank hands them to the library's own ``save_pretrained`` with all of the caller's options, so
the directory is the one a single process writes. :func:`full_state_dict` is the whole state dict under
one-process names on rank 0, which ``ParallelAccelerator.get_state_dict`` returns.

Who writes: the ranks that pass ``is_main_process=True``; when every rank passes it (the default), rank 0
alone. A ``state_dict=`` that is already full (plain tensors of the model's shapes, every entry) is written as
given; the model's own sharded ``state_dict()`` passed on every rank is gathered first; anything else (one
pipeline stage's part, local shards) is refused on every rank, before anything is written.
"""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_plugins.checkpoint import _collect_stages, _full_on_leader, _save_model
from lightning_plugins.faults import summarize
from lightning_plugins.lora import hf_model_of

__all__ = ["full_state_dict", "install_save_pretrained", "save_pretrained"]

#: What to do instead, ending every refusal.
_INSTEAD = (
    " Leave state_dict out: `save_pretrained(out_dir, is_main_process=...)` called on every rank gathers the trained"
    " weights from all ranks itself. Or pass the full state dict that `lightning_plugins.saving.full_state_dict(model)`"
    " (`ParallelAccelerator.get_state_dict(model)`) returns on rank 0 when every rank calls it, and let rank 0 write"
    " (is_main_process=True there). `lightning_plugins.checkpoint.export_hf(model, out_dir)` writes the same files."
)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The full state dict of ``model`` under the names one process gives, on rank 0; ``{}`` on the other ranks.

    Collective: every rank must call it. DTensors are gathered (as CPU tensors) and every pipeline stage's
    entries are collected, so the result is what ``model.state_dict()`` holds in one process.

    Args:
        model: A transformers model or a peft ``PeftModel`` (then the names are the ``PeftModel``'s,
            ``base_model.model....``), parallelized by :func:`lightning_plugins.parallelize` or not.
    """
    return _gather(model, get_model_state_dict(model))


def install_save_pretrained(model: nn.Module) -> None:
    """Replace ``model.save_pretrained`` by :func:`save_pretrained` (on this instance; the class keeps its own)."""
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(save_pretrained, model)


class _View(NamedTuple):
    """What one rank brings to a ``save_pretrained`` call (all-gathered, so every rank decides alike)."""

    writes: bool
    own: dict[str, tuple[tuple[int, ...] | None, bool, str | None]]  # the entries it saves: shape, DTensor, alias of
    given: dict[str, tuple[tuple[int, ...] | None, bool, str | None]] | None  # the same of its state_dict argument


def save_pretrained(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory, ...)`` for a parallelized model; the library's own arguments.

    Collective: every rank calls it. The ranks passing ``is_main_process=True`` write (rank 0 alone when every
    rank passes it); they write what the library's own ``save_pretrained`` writes for the trained weights in one
    process: an HF directory for a transformers model, a peft adapter directory for a ``PeftModel``.

    Raises:
        ValueError: on every rank, before anything is written, for a ``state_dict`` that is not the full one
            (one pipeline stage's part, local shards) and cannot be gathered.
        RuntimeError: when the process group is gone, and on every rank when a writing rank failed.
    """
    call = inspect.signature(type(model).save_pretrained).bind(model, *args, **kwargs)
    options = _arguments(call)
    given = options.pop("state_dict", None)
    if not dist.is_initialized():
        raise RuntimeError(
            f"save_pretrained of this parallelized {type(model).__name__} gathers its weights from every rank, but"
            " torch.distributed is not initialized (the process group was destroyed). Call it before"
            " `destroy_process_group()` on every rank, or export a saved checkpoint with `lightning-plugins export`."
        )
    own = _entries_to_save(model, options)
    views: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(views, _View(bool(options.get("is_main_process", True)), _describe(own), _describe(given)))
    except RuntimeError as error:  # gloo/NCCL errors and timeouts; the usual cause is a rank that did not call it
        raise RuntimeError(
            f"{type(model).__name__}.save_pretrained on a parallelized model is collective: every rank must call it"
            f" (it gathers each rank's shards), but a peer did not answer ({summarize(error)}). Call it on every rank"
            " and choose the writing rank with is_main_process=..., rather than calling it under `if rank == 0:`."
        ) from error
    writers, source = _plan(type(model).__name__, views)
    rank = dist.get_rank()
    if source != "given" and writers:
        state = _deliver(_gather(model, own if source == "model" else given), writers)
    else:
        state = given if rank in writers else {}
    failure = None
    if rank in writers:
        try:
            _write(model, options, state)
        except Exception as error:  # every rank learns of it below, then this rank raises it as it is
            failure = error
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        r, what = failed[0]
        raise RuntimeError(f"save_pretrained: rank {r} could not write {options['save_directory']}: {what}")


# ---------------------------------------------------------------------------------------------------- the call


def _arguments(call: inspect.BoundArguments) -> dict[str, Any]:
    """The call's arguments by name (``**kwargs`` flattened), without the model itself."""
    params = call.signature.parameters
    arguments: dict[str, Any] = {}
    for index, (name, value) in enumerate(call.arguments.items()):
        if params[name].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        elif index > 0:
            arguments[name] = value
    return arguments


def _entries_to_save(model: nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """This rank's (sharded) entries that the library's ``save_pretrained`` writes: all, or a ``PeftModel``'s
    adapter entries (as peft picks them) under their ``state_dict()`` names."""
    sharded = get_model_state_dict(model)  # no communication: this rank's own shards, under one-process names
    if hf_model_of(model) is model:
        return sharded
    from peft.utils import get_peft_model_state_dict

    picked: set[int] = set()
    with warnings.catch_warnings():  # peft's notes come once, from the writing rank's own save_pretrained
        warnings.simplefilter("ignore")
        for name in options.get("selected_adapters") or list(model.peft_config):
            entries = get_peft_model_state_dict(
                model, state_dict=sharded, adapter_name=name,
                save_embedding_layers=options.get("save_embedding_layers", "auto"),
            )  # fmt: skip
            picked |= {id(value) for value in entries.values()}
    own = {key: value for key, value in sharded.items() if id(value) in picked}
    # peft hands back the entries it picks; should it ever build new ones, gather everything rather than miss some.
    return own if len({id(value) for value in own.values()}) == len(picked) else sharded


def _describe(state: dict[str, Any] | None) -> dict[str, tuple[tuple[int, ...] | None, bool, str | None]] | None:
    """Each entry's (global) shape, whether it is a DTensor, and the earlier entry it is the same tensor as."""
    if state is None:
        return None
    first: dict[int, str] = {}
    described = {}
    for key, value in state.items():
        tensor = isinstance(value, Tensor)
        shape = tuple(value.shape) if tensor else None
        described[key] = (shape, isinstance(value, DTensor), first.setdefault(id(value), key) if tensor else None)
    return {key: (shape, dtensor, None if alias == key else alias) for key, (shape, dtensor, alias) in described.items()}


def _plan(owner: str, views: list[_View]) -> tuple[list[int], str]:
    """The writing ranks and where their tensors come from: ``"model"`` (gathered from the model), ``"given"`` (each
    writer's ``state_dict``, already full) or ``"gather"`` (every rank's ``state_dict`` gathered). Every rank decides
    the same from the all-gathered views, so a refusal is raised everywhere at once."""
    flags = [view.writes for view in views]
    writers = [0] if all(flags) else [rank for rank, flag in enumerate(flags) if flag]
    given = [view.given for view in views]
    if all(state is None for state in given):
        return writers, "model"
    expected: dict[str, tuple[tuple[int, ...] | None, bool, str | None]] = {}
    for view in views:  # every pipeline stage's entries
        expected.update(view.own)
    problems = {rank: _not_full(given[rank], expected) for rank in writers}
    if not any(problems.values()):
        return writers, "given"
    same = all(state is not None and list(state.items()) == list(given[0].items()) for state in given)  # order too
    if same and not _not_full(given[0], expected, sharded=True):
        return writers, "gather"  # e.g. the model's own state_dict() on every rank (TP, FSDP2)
    rank, problem = next((rank, problem) for rank, problem in problems.items() if problem)
    raise ValueError(f"{owner}.save_pretrained(state_dict=...): the state dict on rank {rank} {problem}.{_INSTEAD}")


def _not_full(state: dict | None, expected: dict, *, sharded: bool = False) -> str | None:
    """Why ``state`` (described) is not the model's full state dict, or ``None`` if it is (``sharded``: DTensors
    of the full shapes are fine)."""
    if state is None:
        return "is None while other ranks passed one (pass state_dict on every rank or on none)"
    dtensors = [key for key, (_, dtensor, _) in state.items() if dtensor]
    if dtensors and not sharded:
        return f"holds {len(dtensors)} DTensor shards (e.g. {dtensors[0]!r}) that the other ranks do not pass alike"
    missing = [key for key, (_, _, alias) in expected.items() if key not in state and alias not in state]
    if missing:
        stage = " (under pipeline parallelism a rank's model.state_dict() holds only its stages)" if state else ""
        return f"lacks {len(missing)} of the model's {len(expected)} entries{stage}, e.g. {missing[:3]}"
    for key, (shape, _, _) in expected.items():
        if key in state and state[key][0] != shape:
            return f"holds {key!r} of shape {list(state[key][0] or ())} where the model's is {list(shape or ())} (a shard)"
    return None


# ------------------------------------------------------------------------------------------ gathering, writing


def _gather(model: nn.Module, entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` whole, on rank 0 (``{}`` elsewhere): DTensors gathered, pipeline stages collected."""
    hf = hf_model_of(model)
    return _collect_stages(hf, _full_on_leader(hf, entries))


def _deliver(state: dict[str, Any], writers: list[int]) -> dict[str, Any]:
    """Rank 0's gathered ``state`` on every writing rank (``{}`` on the others)."""
    rank = dist.get_rank()
    for writer in writers:
        if writer == 0:
            continue
        if rank == 0:
            dist.send_object_list([state], dst=writer)
        elif rank == writer:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=0)
            state = box[0]
    return state if rank in writers else {}


def _write(model: nn.Module, options: dict[str, Any], state: dict[str, Any]) -> None:
    """The library's own ``save_pretrained`` of ``model`` with the caller's options and the full ``state``."""
    options = {**options, "is_main_process": True}
    directory = options.pop("save_directory")
    if hf_model_of(model) is model:
        with _writes_on_this_rank(model):
            _save_model(model, state, directory, **options)
    else:
        type(model).save_pretrained(model, directory, state_dict=state, **options)


@contextmanager
def _writes_on_this_rank(model: nn.Module) -> Iterator[None]:
    """transformers writes from rank 0 only (``should_save_on_this_rank``); here the caller chose the writer."""
    if dist.get_rank() == 0 or not hasattr(type(model), "should_save_on_this_rank"):
        yield
        return
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        del model.should_save_on_this_rank
