"""What one training step really holds in memory on this rank, by category: the ground truth for the dry run.

:func:`measure_step_memory` runs a few untracked steps, then one step under torch's ``MemTracker``
(``torch.distributed._tools.mem_tracker``), and reports the categories at the moment of the peak and
the resident training state (parameters, gradients, optimizer state) counted from the tensors themselves.
It is framework-free and runs on any rank of a real (gloo/NCCL) world; it is what the planner's dry run
(a fake process group, at real size) is checked against on small layouts that run here for real.

What "peak" means: ``MemTracker.get_tracker_snapshot("peak")`` is the snapshot of *every* category taken
when the tracked total reached its maximum (``_update_peak_stats`` deep-copies the whole current snapshot
whenever the total exceeds the previous peak), not the per-category maxima. The categories therefore
add up to the total.

:class:`StepMemTracker` is ``MemTracker`` with three corrections for what the engine runs; without them the
tracker either fails or files real memory in another category than the one it belongs to:

* **Pipeline schedules** run the backward of micro-batches *inside* the model's forward
  (:meth:`lightning_plugins.parallel.pipeline.Pipeline.step`). ``ModTracker`` resets its module hierarchy to
  ``{"Global"}`` at the end of every backward, so the next micro-batch's stage forward looks like a second
  iteration of a root module (``NotImplementedError: MemTracker does not support memory tracking for
  multiple iterative calls``) and the model's own post-forward then fails (``RuntimeError: The Module
  hierarchy tracking is wrong``). Here the hierarchy is restored to the forwards still running, and a root
  module entered again within the tracked step is accepted like a re-used submodule
  (:class:`~lightning_plugins.planner.lean_tracker.LeanMemTracker`, which keeps no per-module statistics).
* **FSDP2 gathered parameters** live in storages that FSDP2 resizes (``all_gather_outputs``) and fills with
  an out-variant copy that returns nothing. ``MemTracker`` only picks them up once a module holding them is
  entered, and then files them as *parameters* (so that ``parameters`` at the peak reads sharded plus
  gathered). Here they are registered up front, so their resizes are followed from the first all-gather, and
  counted as *temporaries*, like the flat all-gather buffers (which ``MemTracker`` would file as activations
  during forward). The total is the same either way; ``parameters`` is then exactly the resident shards.
* **Frozen parameters** (LoRA's base): ``MemTracker`` registers gradient hooks on every parameter of a module
  it enters, which raises ``cannot register a hook on a tensor that doesn't require gradient``; hooks go on
  trainable parameters only.

And one phantom: DTensor derives an operation's output shape (the first time it meets that operation, shapes and
placements) by running it on fake tensors of the *global* shapes
(``ShardingPropagator._propagate_tensor_meta_non_cached``). Under the dry run's fake mode, which DTensor then
uses, ``MemTracker`` counted those tensors, which no device ever holds: 2.9 GiB of temporaries at the head of
Qwen2.5-32B under TP4, an fp32 copy of the whole ``[152064, 5120]`` weight gradient where each rank holds a
quarter. Whether that fell at the peak's moment depended on when torch first met the operation (torch 2.15 met
this one at the head, 2.13 elsewhere). Here the tracker lets those calls through untracked.

And one leak: ``ModTracker`` hooks the inputs and outputs of every module with
``torch.autograd.graph.register_multi_grad_hook`` and drops the handles. In its default mode that hook's closure
keeps the ``grad_fn`` of each hooked tensor, and the ``grad_fn`` keeps the hook: a cycle through C++ that Python's
garbage collector cannot see (torch 2.13 to 2.15), so the step's graph nodes outlive the step, and with them
FSDP2's (which hold the model, its process groups and their threads). Here the handles are kept and removed when
the tracker exits.

Gradients are filed by ``MemTracker``'s own hooks: on the parameters a module holds when it is entered, and
FSDP2 (torch 2.13) runs the sharded parameters' post-accumulate-grad hooks when it assigns the reduce-scattered
gradients. So under FSDP2 ``gradients`` holds the sharded gradients plus, while a layer's backward runs, the
unsharded gradients autograd computes before they are reduce-scattered and freed.

Pipeline stages' receive buffers (activations and gradients between stages, one per micro-batch, allocated
on the first step and kept) are tracked as *other*, as is the batch.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from functools import wraps
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed._tools.mem_tracker import (
    _TOTAL_KEY,
    _MemRefType,
    _ModState,
    _UpdateType,
    _WeakRefInfo,
)
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from lightning_plugins.planner.intervals import mark_intervals
from lightning_plugins.planner.lean_tracker import LeanMemTracker

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CATEGORIES", "StepMemTracker", "measure_step_memory", "training_state_bytes"]

#: The categories of a measurement, in ``MemTracker``'s order, under the names the planner uses.
CATEGORIES = ("parameters", "buffers", "gradients", "activations", "temporaries", "optimizer", "other")
_NAMES = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.GRAD: "gradients",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.OPT: "optimizer",
    _MemRefType.OTH: "other",
}


class _NestedBackwardModTracker(ModTracker):
    """``ModTracker`` whose hierarchy survives a backward that runs inside a forward (pipeline schedules).

    The stock tracker sets ``parents = {"Global"}`` when any backward ends; modules whose forward is still
    running (the pipelined model around its schedule) then vanish from the hierarchy. This one keeps a count
    of running forwards (outside backward, where activation-checkpoint recomputation also runs forwards) and
    restores them instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self._running: Counter[str] = Counter()
        self._grad_hooks: list[Any] = []

    def __enter__(self) -> Self:
        # ``ModTracker``'s hooks go through the module's ``register_multi_grad_hook``: keep their handles.
        self._register_multi_grad_hook = mod_tracker.register_multi_grad_hook
        mod_tracker.register_multi_grad_hook = self._keep_handle
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        mod_tracker.register_multi_grad_hook = self._register_multi_grad_hook
        for handle in self._grad_hooks:
            handle.remove()  # breaks the hook <-> grad_fn cycle (see the module docstring)
        self._grad_hooks.clear()

    def _keep_handle(self, *args: Any, **kwargs: Any) -> Any:
        handle = self._register_multi_grad_hook(*args, **kwargs)
        self._grad_hooks.append(handle)
        return handle

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        super()._fw_pre_hook(mod, input)
        if not self.is_bw:
            self._running[self._get_mod_name(mod)] += 1

    def _fw_post_hook(self, mod: nn.Module, input: Any, output: Any) -> None:
        if not self.is_bw:
            self._running[self._get_mod_name(mod)] -= 1
        super()._fw_post_hook(mod, input, output)

    def _maybe_set_engine_callback(self) -> None:
        # The stock method, with the final callback restoring the running forwards.
        if self._has_callback:
            return
        for post_bw_callback in reversed(self._post_bw_callbacks_to_enqueue):
            torch.autograd.Variable._execution_engine.queue_callback(post_bw_callback)
        self._post_bw_callbacks_to_enqueue.clear()

        def callback() -> None:
            running = {name: count for name, count in self._running.items() if count > 0}
            self.parents = {"Global", *running}
            self._active_module_cnt.update(running)
            self._has_callback = False

        torch.autograd.Variable._execution_engine.queue_callback(callback)
        self._has_callback = True


class StepMemTracker(LeanMemTracker):
    """``MemTracker`` for one training step of a model made by :func:`lightning_plugins.parallelize`.

    Use it as ``MemTracker``: ``track_external(model, optimizer, ...)``, then run the step inside
    ``with tracker:``. Pass the model to the constructor so that the gathered parameters of its FSDP2 groups
    (and those of its pipeline stages) are followed; see the module docstring for what differs from
    ``MemTracker``.
    """

    def __init__(self, model: nn.Module | None = None, *, left_out: tuple[str, ...] = ()) -> None:
        """``left_out``: categories (:data:`CATEGORIES`) still counted, but left out when choosing the peak's moment:
        those in host memory (FSDP2's CPU offload: the sharded parameters, gradients and optimizer state; the moment
        is the GPU's), or freed as they are produced in the run being modelled (``optimizer_in_backward``'s
        gradients, which the measured step, with the optimizer after backward, accumulates)."""
        super().__init__()
        self._left_out = [reftype for reftype, name in _NAMES.items() if name in left_out]
        self._mod_tracker = _NestedBackwardModTracker()
        self._model = model
        self._fsdp_groups = list(_fsdp_param_groups(model)) if model is not None else []
        #: Storages whose category is fixed (FSDP2's gathered parameters): modules re-file them as parameters.
        self._fixed: dict[_WeakRefInfo, _MemRefType] = {}
        #: Inside DTensor's shape propagation (fake tensors of global shapes): nothing to track.
        self._propagating = 0
        self._propagate: Callable[..., Any] | None = None

    def __enter__(self) -> Self:
        if self._depth == 0:
            if self._model is not None:
                # The sharded parameters, hooked before any forward: a module first entered with FSDP2's parameters
                # gathered lists the gathered copies (a step whose first forward is DPO's no-grad reference one).
                self._hook_gradients(self._model)
            for group in self._fsdp_groups:
                for fsdp_param in group.fsdp_params:
                    for tensor in getattr(fsdp_param, "all_gather_outputs", ()):
                        # Registered at its current size (0 when resharded); resizes are followed from here on.
                        for winfo in self._update_and_maybe_create_winfos(tensor, _MemRefType.TEMP):
                            self._fixed[winfo] = _MemRefType.TEMP
            self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
            ShardingPropagator._propagate_tensor_meta_non_cached = self._untracked(self._propagate)
        super().__enter__()
        if self._left_out:  # MemTracker starts from the totals: the device's share instead
            self._peak_mem = {dev: self.on_device(snap) for dev, snap in self._peak_mem_snap.items()}
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate

    def _untracked(self, propagate: Callable[..., Any]) -> Callable[..., Any]:
        """``propagate`` (DTensor's output-shape propagation) run past this tracker (see the module docstring)."""

        @wraps(propagate)
        def untracked(*args: Any, **kwargs: Any) -> Any:
            self._propagating += 1
            try:
                return propagate(*args, **kwargs)
            finally:
                self._propagating -= 1

        return untracked

    def _update_and_maybe_create_winfos(
        self, t: Tensor, reftype: _MemRefType, update_existing: bool = False
    ) -> set[_WeakRefInfo]:
        winfos = super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        for winfo in winfos:
            fixed = self._fixed.get(winfo)
            if fixed is not None and winfo.reftype != fixed:
                # A module entered while FSDP2 has its parameters gathered lists the gathered copies among its
                # parameters: keep them where they belong (the sharded parameters are counted already).
                old, winfo.reftype = winfo.reftype, fixed
                self._update_snap(_UpdateType.REF, winfo, old_reftype=old)
        return winfos

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # ``MemTracker`` registers its gradient hooks on every parameter, which fails for frozen ones (LoRA's
        # base): hook only those that get gradients. A module whose parameters are swapped for one call by slices of
        # them (linear attention's heads under context parallelism) lists non-leaf tensors: their gradients flow on
        # to the parameters, which are hooked.
        with warnings.catch_warnings():  # MemTracker reads `.grad` of those non-leaf tensors too (None: nothing to count)
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            memory = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            self._hook_gradients(module)
        return memory

    def _hook_gradients(self, module: nn.Module) -> None:
        for param in module.parameters():
            if param.requires_grad and param.is_leaf and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(self._file_gradient),
                    param.register_post_accumulate_grad_hook(lambda p: self._file_gradient(p.grad)),
                )

    def _file_gradient(self, grad: Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self._propagating:
            return func(*args, **(kwargs or {}))
        res = super().__torch_dispatch__(func, types, args, kwargs)
        if res is not NotImplemented and func is torch.ops.fsdp.all_gather_copy_in.default:
            # (all-gather input, flat all-gather output): communication buffers, not activations.
            for tensor in res:
                self._update_and_maybe_create_winfos(tensor, _MemRefType.TEMP)
        return res

    def _update_peak_stats(self, peak_state: _ModState) -> None:
        # Only the peak per device: ``MemTracker`` also updates every active module's own peak after every
        # operation, which makes a step's tracking cost grow with the square of the number of layers.
        for dev, snapshot in self._curr_mem_snap.items():
            on_device = self.on_device(snapshot)
            if self._peak_mem.get(dev, -1) < on_device:
                self._peak_mem[dev] = on_device
                self._peak_mem_snap[dev] = dict(snapshot)  # {category: bytes}: a shallow copy is a full one

    def on_device(self, snapshot: dict[Any, int]) -> int:
        """The bytes of a snapshot (``{category: bytes}``) that choose the peak's moment: its total less ``left_out``."""
        return snapshot.get(_TOTAL_KEY, 0) - sum(snapshot.get(reftype, 0) for reftype in self._left_out)

    def restart_peak(self) -> None:
        """Forget the peak so far: the next :meth:`by_category` ``("peak")`` covers what runs from now on."""
        self._peak_mem.clear()
        self._peak_mem_snap.clear()

    def by_category(self, kind: str = "peak", device: torch.device | str = "cpu") -> dict[str, int]:
        """The categories on ``device`` (bytes) and their ``"total"``: at the moment of the peak (``"peak"``) or now
        (``"current"``)."""
        snapshot = self.get_tracker_snapshot(kind).get(torch.device(device), {})
        categories = {name: int(snapshot.get(reftype, 0)) for reftype, name in _NAMES.items()}
        categories["total"] = int(snapshot.get(_TOTAL_KEY, 0))
        return categories


def _fsdp_param_groups(model: nn.Module) -> Iterator[Any]:
    """FSDP2 parameter groups of ``model`` and of its pipeline stages (each stage is its own FSDP2 root)."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_plugins.parallel import pipeline_of

    pipeline = pipeline_of(model)
    roots = [model, *(pipeline.stages.values() if pipeline is not None else ())]
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if isinstance(module, FSDPModule) and id(module) not in seen:
                seen.add(id(module))
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    yield group


def _pipeline_buffers(model: nn.Module) -> list[Tensor]:
    """Receive buffers of this rank's pipeline stages (activations and gradients, one per micro-batch), of every
    schedule the runtime keeps (the last training one and the last evaluation one: a DPO step runs both)."""
    from lightning_plugins.parallel import pipeline_of

    pipeline = pipeline_of(model)
    if pipeline is None:
        return []
    kept = [schedule for _, schedule in getattr(pipeline, "_schedules", {}).values()]
    schedules = kept or [schedule for schedule in [getattr(pipeline, "_schedule", None)] if schedule is not None]
    buffers, seen = [], set()
    for schedule in schedules:
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
                for info in infos:
                    buffer = getattr(info, "buffer", None)
                    if buffer is not None and id(buffer) not in seen:
                        seen.add(id(buffer))
                        buffers.append(buffer)
    return buffers


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards), padding included."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None:
            storage = _local(tensor).untyped_storage()
            storages[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(storages.values())


def training_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Resident bytes of this rank's parameters, gradients (of trainable parameters) and optimizer state.

    Counted from the distinct storages of the local shards (FSDP2's dim-0 padding included), not from the
    tracker: an independent view of the state the tracker's categories should contain.
    """
    params = list(model.parameters())
    states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]
    return {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes(p.grad for p in params if p.requires_grad),
        "optimizer": _storage_bytes(states),
    }


def _run_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor],
    after_backward: Callable[[], None] | None = None,
    loss_fn: Callable[[nn.Module, dict[str, Tensor]], Tensor] | None = None,
) -> None:
    """One training step: forward and backward (through the schedule under pipelining), optimizer step."""
    from lightning_plugins.parallel import pipeline_of

    if pipeline_of(model) is not None:  # forward and backward of every micro-batch; the loss comes back detached
        model(**batch) if loss_fn is None else loss_fn(model, batch)
    else:
        (model(**batch).loss if loss_fn is None else loss_fn(model, batch)).backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_step_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor],
    *,
    steps_before: int = 1,
    device: torch.device | str = "cpu",
    loss_fn: Callable[[nn.Module, dict[str, Tensor]], Tensor] | None = None,
    held: tuple[nn.Module, ...] = (),
) -> dict[str, dict[str, int]]:
    """Peak memory of one real training step on this rank, by category, and the resident training state.

    Runs ``steps_before`` untracked steps (the first optimizer step creates the optimizer state, and DTensor
    propagation on the first step would be counted at global shape), then one step under
    :class:`StepMemTracker`: ``model(**batch).loss.backward()`` (under pipeline parallelism ``model(**batch)``
    runs forward and backward of all micro-batches inside the schedule), ``optimizer.step()``,
    ``optimizer.zero_grad(set_to_none=True)``. Call it on every rank at once (the step runs collectives).

    Args:
        model: A model made by :func:`lightning_plugins.parallelize` (or a plain one), in training mode.
        optimizer: Its optimizer (over this rank's trainable parameters).
        batch: This rank's batch (``input_ids``, ``labels``, ...); under context parallelism already sharded
            with :func:`lightning_plugins.parallel.context_parallel_batch`.
        steps_before: Untracked steps first; at least 1 so that the optimizer state exists.
        device: The device whose memory is reported.
        loss_fn: ``loss_fn(model, batch)``, the loss backpropagated in place of ``model(**batch).loss`` (a
            preference objective's: :func:`~lightning_plugins.planner.objective_step.step_loss`); under pipelining
            called in place of ``model(**batch)``, running backward through the schedule itself.
        held: Other modules the step uses and holds all along, tracked with the model (a frozen DPO reference).

    Returns:
        ``{"peak": {category: bytes, ..., "total": bytes}, "intervals": [...], "state": {"parameters", "gradients",
        "optimizer"}, "after_backward": {category: bytes, ..., "total": bytes}}``: the categories of :data:`CATEGORIES`
        as the tracker saw them at the moment of the peak, and at the peak of each interval of the step
        (:func:`~lightning_plugins.planner.intervals.mark_intervals`, as the dry run cuts it); the state from
        :func:`training_state_bytes`, counted from the tensors right after the tracked backward; and the tracker's
        categories at that same moment (which should hold exactly that state: a check of the tracker's bookkeeping).

    Raises:
        ValueError: for ``steps_before < 1`` (naming why the warm-up is needed).
    """
    if steps_before < 1:
        raise ValueError(
            f"measure_step_memory: steps_before={steps_before}, but at least 1 untracked step is needed: the first"
            " optimizer step creates the optimizer state, and DTensor propagation on the first step would be"
            " counted at global shape. Use steps_before=1."
        )
    for _ in range(steps_before):
        _run_step(model, optimizer, batch, loss_fn=loss_fn)
    tracker = StepMemTracker(model)
    buffers = [buffer for module in (model, *held) for buffer in _pipeline_buffers(module)]
    tracker.track_external(model, optimizer, *batch.values(), *buffers, *held)
    result: dict[str, Any] = {}
    intervals, mark, handles = mark_intervals(tracker, model, lambda: tracker.by_category("peak", device))

    def after_backward() -> None:
        result["after_backward"] = tracker.by_category("current", device)
        result["state"] = training_state_bytes(model, optimizer)
        mark()

    with tracker:
        _run_step(model, optimizer, batch, after_backward=after_backward, loss_fn=loss_fn)
        mark()
    for handle in handles:
        handle.remove()
    kept = intervals.kept()
    return {"peak": max(kept, key=lambda interval: interval["total"]), "intervals": kept, **result}
