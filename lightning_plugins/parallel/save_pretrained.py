"""Saving a parallelized model the way users already save: ``save_pretrained`` and a full ``state_dict``.

After :func:`lightning_plugins.parallelize` each rank holds shards (DTensors under TP, FSDP2 and CP) or only its
pipeline stages, so the library's own ``model.save_pretrained(out_dir)`` fails on the DTensors, or under
pipeline parallelism writes one stage's weights. ``parallelize`` therefore installs :func:`save_pretrained` on
the model it parallelized (the transformers model and the peft ``PeftModel`` around it): every rank calls it, as
the HF and Accelerate habit is, and the trained tensors are gathered with the export machinery of
:mod:`lightning_plugins.parallel.gather` (each DTensor by the ranks that share it, pipeline stages collected on rank
0). The writing rank then hands them to transformers' own ``save_pretrained`` with all of the caller's options;
for a ``PeftModel`` it writes the adapter directory with ``export_hf``'s writer, the adapters picked and named by
peft on each stage (peft picks by visiting the layers, which a pipeline stage has only some of), plus peft's
model card. So the directory is the one a single process writes, and its tensors are those ``export_hf`` writes.
:func:`full_state_dict` is the whole state dict under one-process names on rank 0, which
``ParallelAccelerator.get_state_dict`` returns.

Handed a ``state_dict`` of plain tensors (what ``full_state_dict`` / ``ParallelAccelerator.get_state_dict`` give:
the full one on the main process, ``{}`` on the others), ``save_pretrained`` is what the libraries do with it and
nothing more: no collective, so ``if accelerator.is_main_process: model.save_pretrained(out, state_dict=state)``
works. The writing rank (rank 0 when ``is_main_process`` is left at its default, as in transformers; else each rank
passing ``is_main_process=True``) checks it locally (every entry of the model, of its global shapes, before anything
is written) and writes it with transformers' (or peft's) own ``save_pretrained``; the other ranks return.

Without one (or with the model's own sharded ``state_dict()``, DTensors, on every rank) the call is collective: the
ranks passing ``is_main_process=True`` write (rank 0 alone when every rank passes it), from what is gathered.
A rank that calls it alone fails after :data:`ARRIVAL_TIMEOUT_S` seconds naming the fix, never waits out the
collective timeout. The files are written into ``save_directory`` as the libraries write them (next to what is
there, e.g. a tokenizer), not swapped in atomically as ``export_hf`` does.
"""

from __future__ import annotations

import copy
import inspect
import os
import time
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_plugins.parallel.hf_model import hf_model_of
from lightning_plugins.errors import summarize
from lightning_plugins.parallel.gather import collect_stages, full_on_leader, stage_leader

__all__ = ["full_state_dict", "install_save_pretrained", "save_adapters", "save_model", "save_pretrained"]

#: How long a rank waits, in a collective ``save_pretrained``, for every other rank to call it too.
ARRIVAL_TIMEOUT_S = 30.0
_ARRIVALS = "lightning_plugins/save_pretrained/arrivals"
_calls_here = 0  # this process's completed collective calls: the store key of the next one

#: What to do instead, ending every refusal.
_INSTEAD = (
    " Leave state_dict out: `save_pretrained(out_dir, is_main_process=...)` called on every rank gathers the trained"
    " weights from all ranks itself. Or pass the full state dict that `lightning_plugins.parallel.save_pretrained.full_state_dict(model)`"
    " (`ParallelAccelerator.get_state_dict(model)`) returns on rank 0 when every rank calls it, and let rank 0 write"
    " (is_main_process=True there). `lightning_plugins.checkpoint.live_export.export_hf(model, out_dir)` writes the same files."
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
    files: dict[str, dict[str, str]] | None  # PeftModel: per adapter, the adapter file's key -> the state_dict name


def save_pretrained(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory, ...)`` for a parallelized model; the library's own arguments.

    With a ``state_dict`` of plain tensors (the full one where it is written, as ``get_state_dict`` gives it): no
    collective; rank 0 writes it (or, when ``is_main_process`` is passed, each rank passing ``True``).
    Otherwise collective: every rank calls it, and the ranks passing ``is_main_process=True`` write (rank 0 alone
    when every rank passes it). A transformers model is written by transformers' own ``save_pretrained`` with the
    full trained tensors; a ``PeftModel`` writes its adapter directory (``adapter_config.json``, the adapters'
    weights as peft picks and names them, the model card), as ``PeftModel.save_pretrained`` does.

    Raises:
        ValueError: before anything is written, for a ``state_dict`` that is not the full one (one pipeline
            stage's part, local shards): on the writing rank, or on every rank when it holds DTensors.
        RuntimeError: when the process group is gone, when a peer did not call a collective save within
            :data:`ARRIVAL_TIMEOUT_S`, and on every rank when a writing rank failed.
    """
    call = inspect.signature(type(model).save_pretrained).bind(model, *args, **kwargs)
    options = _arguments(call)
    given = options.pop("state_dict", None)
    owner = type(model).__name__
    if given is not None and not any(isinstance(value, DTensor) for value in given.values()):
        _save_given(model, options, given)  # the libraries' own save of what it was handed: no collective
        return
    if not dist.is_initialized():
        raise RuntimeError(
            f"save_pretrained of this parallelized {owner} gathers its weights from every rank, but torch.distributed"
            " is not initialized (the process group was destroyed). Call it before `destroy_process_group()` on every"
            " rank, or export a saved checkpoint with `lightning-plugins export`."
        )
    _wait_for_every_rank(owner)
    own, files = _entries_to_save(model, options)
    # The ranks of a pipeline stage hold the same entries (shards of the same global shapes): its leader tells them.
    leader = dist.get_rank() == stage_leader(hf_model_of(model))
    view = _View(bool(options.get("is_main_process", True)), _describe(own) if leader else {}, _describe(given),
                 files if leader else None)  # fmt: skip
    views: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(views, view)
    except RuntimeError as error:  # gloo/NCCL errors and timeouts; the usual cause is a rank that did not call it
        raise RuntimeError(
            f"{owner}.save_pretrained on a parallelized model is collective: every rank must call it (it gathers each"
            f" rank's shards), but a peer did not answer ({summarize(error)}). Call it on every rank and choose the"
            " writing rank with is_main_process=..., rather than calling it under `if rank == 0:`."
        ) from error
    writers, source = _plan(owner, views)
    rank = dist.get_rank()
    if source != "given" and writers:
        state = _deliver(_gather(model, own if source == "model" else given), writers)
    else:
        state = given if rank in writers else {}
    failure = None
    if rank in writers:
        try:
            _write(model, options, state, views)
        except Exception as error:  # every rank learns of it below, then this rank raises it as it is
            failure = error
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if failure is None else summarize(failure))
    if failure is not None:
        raise failure
    failed = [(r, what) for r, what in enumerate(failures) if what is not None]
    if failed:
        rank, what = failed[0]
        raise RuntimeError(f"{owner}.save_pretrained: rank {rank} could not write its directory: {what}")


# ---------------------------------------------------------------------------------------------------- the call


def _save_given(model: nn.Module, options: dict[str, Any], given: dict[str, Any]) -> None:
    """Write ``given`` (plain tensors) as the library's own ``save_pretrained`` would, on this rank alone.

    Raises:
        ValueError: before anything is written, when this rank would write and ``given`` is not the full state
            dict (entries missing, e.g. one pipeline stage's part; local shards).
    """
    if not options.get("is_main_process", True):
        return
    if "is_main_process" not in options and dist.is_initialized() and dist.get_rank() != 0:
        return  # as transformers: left at its default, rank 0 writes (the others hold `{}` from `get_state_dict`)
    owner = type(model).__name__
    own, _ = _entries_to_save(model, options)
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = _not_full(_describe(given), _full_entries(model, own))
    if problem:
        raise ValueError(f"{owner}.save_pretrained(state_dict=...): the state dict on rank {rank} {problem}.{_INSTEAD}")
    options = {**options, "is_main_process": True}
    directory = options.pop("save_directory")
    if hf_model_of(model) is model:
        with _writes_on_this_rank(model):
            save_model(model, given, directory, **options)
    else:  # peft picks the adapters' entries from the full state dict by name
        type(model).save_pretrained(model, directory, state_dict=given, **options)


def _full_entries(model: nn.Module, own: dict[str, Any]) -> dict[str, tuple[tuple[int, ...] | None, bool, str | None]]:
    """The entries the full state dict holds, described: this rank's own (global shapes), and under pipeline
    parallelism every stage's, read from the model's class built from its config on the meta device."""
    from lightning_plugins.parallel.pipeline.apply import pipeline_of

    described = _describe(own) or {}
    hf = hf_model_of(model)
    if pipeline_of(hf) is None or hf is not model:  # a peft model's entries are the adapters peft picks by name
        return described
    hf_class = next(cls for cls in type(hf).__mro__ if cls.__module__.startswith("transformers."))
    config = copy.deepcopy(hf.config)
    config._attn_implementation = "eager"  # any: nothing runs
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = hf_class(config)
    return {**(_describe(whole.state_dict()) or {}), **described}


def _wait_for_every_rank(owner: str) -> None:
    """Return once every rank has entered this collective call; raise after :data:`ARRIVAL_TIMEOUT_S` otherwise.

    Ranks count themselves in the process group's store (no collective, so a rank alone is not stuck in one).
    """
    global _calls_here
    world = dist.get_world_size()
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"{_ARRIVALS}/{_calls_here}"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while arrived < world:
        if time.monotonic() > deadline:
            store.add(key, -1)  # a later call, by every rank, counts afresh
            raise RuntimeError(
                f"{owner}.save_pretrained on a parallelized model without a full state dict is collective: every rank"
                f" must call it (it gathers each rank's shards), but only {arrived} of {world} ranks did within"
                f" {ARRIVAL_TIMEOUT_S:g} s. Either call it on every rank and choose the writer with"
                " is_main_process=... (not under `if accelerator.is_main_process:`), or gather first on every rank"
                " (`state = accelerator.get_state_dict(model)`, or"
                " `lightning_plugins.parallel.save_pretrained.full_state_dict(model)`) and save from the main process"
                " alone: `model.save_pretrained(out_dir, state_dict=state)`."
            )
        time.sleep(0.02)
        arrived = store.add(key, 0)
    _calls_here += 1


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


def _entries_to_save(model: nn.Module, options: dict[str, Any]) -> tuple[dict[str, Any], dict | None]:
    """This rank's (sharded) entries that are written, under their ``state_dict()`` names: every entry of a
    transformers model; of a ``PeftModel``, those peft picks for each adapter on this rank's stages, with the key
    each has in the adapter file (peft picks by visiting the layers, so each pipeline stage names its own)."""
    sharded = get_model_state_dict(model)  # no communication: this rank's own shards, under one-process names
    if hf_model_of(model) is model:
        return sharded, None
    from peft.utils import get_peft_model_state_dict

    if options.get("path_initial_model_for_weight_conversion") is not None:
        raise ValueError(
            f"{type(model).__name__}.save_pretrained(path_initial_model_for_weight_conversion=...) is not available on"
            " a parallelized model. Save the adapter as it is, then convert it in one process:"
            " PeftModel.from_pretrained(base, adapter_dir).save_pretrained(out,"
            " path_initial_model_for_weight_conversion=...)."
        )
    name_of: dict[int, str] = {}
    for key, value in sharded.items():
        name_of.setdefault(id(value), key)
    files: dict[str, dict[str, str]] = {}
    with warnings.catch_warnings():  # peft's notes come from the one-process habit once; not from every rank
        warnings.simplefilter("ignore")
        for adapter in options.get("selected_adapters") or list(model.peft_config):
            entries = get_peft_model_state_dict(
                model, state_dict=sharded, adapter_name=adapter,
                save_embedding_layers=options.get("save_embedding_layers", "auto"),
            )  # fmt: skip
            files[adapter] = {key: name_of.get(id(value), "") for key, value in entries.items()}
    wanted = {name for names in files.values() for name in names.values()}
    return {key: value for key, value in sharded.items() if key in wanted}, files


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
    return {
        key: (shape, dtensor, None if alias == key else alias) for key, (shape, dtensor, alias) in described.items()
    }


def _plan(owner: str, views: list[_View]) -> tuple[list[int], str]:
    """The writing ranks and where their tensors come from: ``"model"`` (gathered from the model), ``"given"`` (each
    writer's ``state_dict``, already full) or ``"gather"`` (every rank's ``state_dict`` gathered). Every rank decides
    the same from the all-gathered views, so a refusal is raised everywhere at once."""
    flags = [view.writes for view in views]
    writers = [0] if all(flags) else [rank for rank, flag in enumerate(flags) if flag]
    for view in views:
        if view.files is not None and any("" in names.values() for names in view.files.values()):
            raise ValueError(  # peft built new tensors instead of picking the model's: nothing to gather them from
                f"{owner}.save_pretrained: peft's adapter state dict holds tensors that are not the model's own, which"
                " cannot be gathered from a parallelized model. Export it with"
                " `lightning_plugins.checkpoint.live_export.export_hf(model, out_dir)`."
            )
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
            got, want = list(state[key][0] or ()), list(shape or ())
            return f"holds {key!r} of shape {got} where the model's is {want} (a shard)"
    return None


# ------------------------------------------------------------------------------------------ gathering, writing


def _gather(model: nn.Module, entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` whole, on rank 0 (``{}`` elsewhere): DTensors gathered, pipeline stages collected."""
    hf = hf_model_of(model)
    return collect_stages(hf, full_on_leader(hf, entries))


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


def _write(model: nn.Module, options: dict[str, Any], state: dict[str, Any], views: list[_View]) -> None:
    """What the library's own ``save_pretrained`` writes for ``model`` with the full ``state``."""
    options = {**options, "is_main_process": True}
    directory = options.pop("save_directory")
    if hf_model_of(model) is model:  # transformers' own, with the caller's options
        with _writes_on_this_rank(model):
            save_model(model, state, directory, **options)
        return
    weights: dict[str, dict[str, Tensor]] = {}
    for view in views:  # every stage's adapter entries, named as peft names them
        for adapter, names in (view.files or {}).items():
            weights.setdefault(adapter, {}).update({key: state[name] for key, name in names.items()})
    os.makedirs(directory, exist_ok=True)
    model.create_or_update_model_card(directory)
    save_adapters(model, weights, Path(directory), safe_serialization=options.get("safe_serialization", True))


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


# ------------------------------------------------------------------------------------------- the writers


def save_model(model: nn.Module, state: dict[str, Tensor], directory: str | Path, **options: Any) -> None:
    """transformers' own ``save_pretrained`` of ``model`` with the full ``state`` (and the caller's ``options``)."""
    # The class's method: `parallelize` replaced the instance's by the collective one.
    type(model).save_pretrained(model, directory, state_dict=state, **options)
    # transformers records the class it saves from; a pipelined model's class is our subclass of it.
    hf_class = next(cls for cls in type(model).__mro__ if cls.__module__.startswith("transformers."))
    if model.config.architectures != [hf_class.__name__]:
        model.config.architectures = [hf_class.__name__]
        model.config.save_pretrained(directory)


def save_adapters(
    model: nn.Module, weights: dict[str, dict[str, Tensor]], directory: Path, *, safe_serialization: bool = True
) -> None:
    """peft's adapter layout for each adapter in ``weights``: ``default`` at the top, any other adapter in a
    sub-directory of its name (``safe_serialization=False``: ``adapter_model.bin``, as peft writes it)."""
    from safetensors.torch import save_file

    for name in weights:
        config = model.peft_config[name]
        target = directory if name == "default" else directory / name
        target.mkdir(parents=True, exist_ok=True)
        tensors = {key: value.contiguous() for key, value in weights[name].items()}
        if safe_serialization:
            save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
        else:
            torch.save(tensors, target / "adapter_model.bin")
        saved = copy.deepcopy(config)
        saved.inference_mode = True
        saved.save_pretrained(str(target))
