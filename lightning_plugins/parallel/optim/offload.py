"""Host memory as a memory lever: the optimizer step on the host (ZeRO-Offload style) and saved activations on it.

* :class:`HostOffloadOptimizer` (``memory.optimizer_offload``): parameters and gradients stay on the GPU; the
  optimizer state (AdamW's two moments and its step) and the step itself live on the host. Each step copies
  the gradients to the host, runs the wrapped ``torch.optim`` optimizer on host copies of the parameters, and
  copies the updated parameters back. :func:`offload_optimizer` builds one for a user's own optimizer class.
* :func:`to_host` / :func:`from_host`: one saved tensor to host memory and back, the pack and unpack of
  activation offload (``memory.activation_offload``, applied per decoder layer by
  :mod:`lightning_plugins.parallel.memory.activation`).

Why not torchao's ``CPUOffloadOptimizer``: it asserts a CUDA or XPU device at construction (so nothing of it runs
on CPU, where the suite proves parity), it copies each gradient to the host in a post-accumulate-grad hook,
i.e. *before* gradient clipping scales it (a clipped run silently trains on unclipped gradients), and its
``state_dict`` is a list of per-parameter optimizers that ``torch.distributed.checkpoint`` cannot map to parameter
names. This class copies the gradients when ``step`` runs, after clipping, and keeps the state dict of a plain
``torch.optim`` optimizer over the model's own parameters (DTensor state for DTensor parameters), so DCP
checkpoints, Lightning and Accelerate treat it as the optimizer it wraps.

On a machine without CUDA the host is the device: the copies still run (unpinned), so the code path is tested.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["HostOffloadOptimizer", "from_host", "host_device", "offload_optimizer", "to_host"]

#: Where offloaded tensors go. The planner's dry run points it at the meta device (:func:`host_device`) so that
#: its memory tracker tells offloaded bytes apart from the (fake, CPU) device's.
_HOST = torch.device("cpu")


@contextlib.contextmanager
def host_device(device: str | torch.device) -> Iterator[None]:
    """Offload to ``device`` instead of the CPU while the context is open (the planner's dry run uses ``"meta"``)."""
    global _HOST
    previous, _HOST = _HOST, torch.device(device)
    try:
        yield
    finally:
        _HOST = previous


def _pinned(tensor: Tensor) -> bool:
    """Host buffers of CUDA tensors are pinned: copies to and from them run asynchronously."""
    return tensor.is_cuda and _HOST.type == "cpu"


def _host_empty(local: Tensor) -> Tensor:
    """An uninitialised host tensor of ``local``'s shape, strides and dtype (pinned for a CUDA tensor)."""
    return torch.empty_like(local, device=_HOST, pin_memory=_pinned(local))


def _host_copy(local: Tensor, *, non_blocking: bool = True) -> Tensor:
    """A host tensor of ``local``'s shape, strides and values."""
    host = _host_empty(local)
    if _HOST.type == "meta":  # the dry run: nothing to copy
        return host
    return host.copy_(local, non_blocking=non_blocking and _pinned(local))


# --------------------------------------------------------------------------------------------- saved tensors


class _Offloaded(NamedTuple):
    """A saved tensor in host memory: its local data and what rebuilds it on its device."""

    host: Tensor
    device: torch.device
    pinned: bool
    dtensor: tuple | None  # (mesh, placements, shape, stride) of a DTensor


def _is_parameter(tensor: Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` saved by a linear): it stays where it is."""
    return isinstance(tensor, nn.Parameter) or isinstance(getattr(tensor, "_base", None), nn.Parameter)


def _overlapping(tensor: Tensor) -> bool:
    """An expanded view (a zero stride over a dimension of size > 1): copying it would materialise it."""
    return any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


def to_host(tensor: Tensor) -> Tensor | _Offloaded:
    """The pack hook of activation offload: ``tensor``'s data moved to host memory (a DTensor's local shard).

    Parameters and views of them stay (they are resident anyway), as do expanded views (a copy would be larger
    than what they reference).
    """
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if _is_parameter(tensor) or _overlapping(local) or local.device.type == "meta" and _HOST.type != "meta":
        return tensor
    spec = None
    if isinstance(tensor, DTensor):
        spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
    return _Offloaded(_host_copy(local), local.device, _pinned(local), spec)


def from_host(packed: Tensor | _Offloaded) -> Tensor:
    """The unpack hook of activation offload: the tensor :func:`to_host` packed, back on its device."""
    if not isinstance(packed, _Offloaded):
        return packed
    local = packed.host.to(packed.device, non_blocking=packed.pinned)
    if packed.dtensor is None:
        return local
    mesh, placements, shape, stride = packed.dtensor
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


# ------------------------------------------------------------------------------------------------ optimizer


def _local(tensor: Tensor) -> Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _data(param: Tensor) -> Tensor:
    """The tensor holding ``param``'s (local) values. Not ``param.detach()`` for a DTensor: its local alias is made
    below autograd and starts a version counter of its own."""
    return param._local_tensor if isinstance(param, DTensor) else param.detach()


def _version(param: Tensor) -> tuple[int, int]:
    """What in-place writes to ``param`` bump: its own version counter (writes through the DTensor, e.g.
    ``load_state_dict``) and its local tensor's (writes to the shard, e.g. a DCP load; and this optimizer's)."""
    return param._version, _data(param)._version


def _local_grad(param: Tensor) -> Tensor:
    """This rank's part of ``param.grad``, laid out like the parameter (a partial sum is reduced first, as the
    wrapped optimizer would do on the DTensors)."""
    grad = param.grad
    assert grad is not None
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return _local(grad)


def _as_param(value: Tensor, param: Tensor) -> Tensor:
    """A host state tensor of ``param``'s local shape, seen as ``param`` is (a DTensor for a DTensor parameter)."""
    if isinstance(param, DTensor) and value.dim() and value.shape == _local(param).shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())  # fmt: skip
    return value


def _as_local(value: Any, param: Tensor, owner: str, key: str) -> Any:
    """The inverse of :func:`_as_param` for a loaded state value (DTensor, local shard, or a 0-d step)."""
    if not isinstance(value, Tensor):
        return value
    if isinstance(value, DTensor):
        if isinstance(param, DTensor) and tuple(value.placements) != tuple(param.placements):
            value = value.redistribute(param.device_mesh, param.placements)
        value = value.to_local()
    if value.dim() and value.shape != _local(param).shape:
        raise ValueError(
            f"{owner}.load_state_dict: state {key!r} has shape {tuple(value.shape)}, but this rank's shard of the"
            f" parameter has {tuple(_local(param).shape)}. Load sharded optimizer state with"
            " torch.distributed.checkpoint (get_optimizer_state_dict / set_optimizer_state_dict), which reshards it."
        )
    return value


#: Optimizers whose fused CPU kernel the host step uses unless told otherwise: an H100 run of an 850M-parameter
#: model stepped in 0.29 s fused against 1.1-1.5 s with the per-parameter loop (benchmarks/offload_gpu_h100.json).
_FUSED_ON_CPU = (torch.optim.AdamW, torch.optim.Adam)
#: Group keys that choose the host optimizer's implementation rather than the update: not copied from the groups.
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")
_NOT_SYNCED = ("params", *_IMPLEMENTATION)


class HostOffloadOptimizer(Optimizer):
    """A ``torch.optim`` optimizer whose state and step live in host memory; parameters and gradients stay on the GPU.

    Each :meth:`step` copies the gradients (after any clipping) into pinned host buffers, runs
    ``optimizer_class`` on host copies of the parameters, and copies the updated parameters back (asynchronously:
    the next forward on the same stream waits for them). The parameters on the device stay the truth: a host copy
    is refreshed whenever its parameter was changed in place by anything but this optimizer (a checkpoint load),
    which the version counters of the parameter and of its local shard tell. DTensor parameters (FSDP2, TP) are handled shard by shard: the
    update is elementwise, so every rank updates its own shard as the wrapped optimizer would.

    ``param_groups`` holds the model's parameters and the hyperparameters: learning-rate schedulers drive it as
    they drive the wrapped optimizer. ``state`` and ``state_dict()`` show the host state keyed by those parameters
    (as DTensors for DTensor parameters), so ``torch.distributed.checkpoint`` saves and reshards it;
    ``load_state_dict`` puts loaded state back on the host.

    Args:
        params: Parameters or parameter groups, as for any ``torch.optim`` optimizer.
        optimizer_class: The optimizer to run on the host (any elementwise one: ``torch.optim.AdamW``, ``Adam``,
            ``SGD``, ...).
        **kwargs: Its hyperparameters (``lr``, ``betas``, ``weight_decay``, ...).
    """

    def __init__(
        self, params: Iterable[Tensor] | Iterable[dict[str, Any]], optimizer_class: type[Optimizer] = torch.optim.AdamW,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                f"{type(self).__name__}: optimizer_class must be a torch.optim.Optimizer subclass (e.g."
                f" torch.optim.AdamW), got {optimizer_class!r}."
            )
        if optimizer_class is type(self):
            raise TypeError(f"{type(self).__name__}: wrap the optimizer to run on the host, not another offload.")
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = dict(kwargs)
        # The wrapped class's defaults, so that every group shows every hyperparameter (schedulers read "lr").
        defaults = optimizer_class([torch.empty(1)], **kwargs).defaults
        self._host: Optimizer | None = None
        self._pairs: list[tuple[Tensor, Tensor, Tensor]] = []  # (parameter, host copy, host gradient buffer)
        self._versions: list[tuple[int, int]] = []
        super().__init__(params, defaults)

    # -- the state lives on the host: ``state`` is a view of it (assigning to it changes nothing) --

    @property  # type: ignore[override]
    def state(self) -> dict[Tensor, dict[str, Any]]:
        """The host state of each parameter that has any, keyed by the parameter (DTensor values for DTensor ones).

        A fresh view each time: moving it elsewhere (Lightning and Accelerate move optimizer state to the GPU after
        loading) leaves the host state where it is.
        """
        if self._host is None:
            return {}
        view = {}
        for param, host, _ in self._pairs:
            state = self._host.state.get(host)
            if state:
                view[param] = {key: _as_param(value, param) if isinstance(value, Tensor) else value
                               for key, value in state.items()}  # fmt: skip
        return view

    @state.setter
    def state(self, value: Any) -> None:
        if value:  # Optimizer.__init__ and __setstate__ assign an empty state
            raise TypeError(
                f"{type(self).__name__}.state is a view of the host state; use load_state_dict to replace it."
            )

    def _params(self) -> list[Tensor]:
        return [param for group in self.param_groups for param in group["params"]]

    def _ensure_host(self) -> Optimizer:
        """The host optimizer over copies of the current parameters (built on first use, and again when the
        parameters were replaced before any step: Accelerate's ``prepare`` points the groups at sharded ones)."""
        params = self._params()
        if self._host is not None and len(params) == len(self._pairs) and all(
            param is pair[0] for param, pair in zip(params, self._pairs)
        ):
            return self._host
        if self._host is not None and self._host.state:
            raise RuntimeError(
                f"{type(self).__name__}: the optimizer's parameters were replaced after it stepped; its state belongs"
                " to the old ones. Build the optimizer after the model is parallelized (or prepared)."
            )
        with torch.no_grad():
            self._pairs = []
            for param in params:
                local = _data(param)
                self._pairs.append((param, _host_copy(local, non_blocking=False), _host_empty(local)))
        self._versions = [_version(param) for param in params]
        hosts = iter(host for _, host, _ in self._pairs)
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [next(hosts) for _ in group["params"]]}
            for group in self.param_groups
        ]
        kwargs = dict(self.optimizer_kwargs)
        if self.optimizer_class in _FUSED_ON_CPU and _HOST.type == "cpu" and not {"fused", "foreach"} & kwargs.keys():
            kwargs["fused"] = True
        for group in groups:
            for key in _IMPLEMENTATION:
                group.pop(key, None)
        self._host = self.optimizer_class(groups, **kwargs)
        return self._host

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Gradients to the host, the wrapped optimizer's step there, parameters back to the device."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        host_optimizer = self._ensure_host()
        for group, host_group in zip(self.param_groups, host_optimizer.param_groups):
            host_group.update((key, value) for key, value in group.items() if key not in _NOT_SYNCED)
        stepped, devices = set(), set()
        for index, (param, host, buffer) in enumerate(self._pairs):
            local = _data(param)
            if _version(param) != self._versions[index]:  # changed in place by someone else: refresh the copy
                host.copy_(local, non_blocking=_pinned(local))
            if param.grad is None:
                host.grad = None
                continue
            buffer.copy_(_local_grad(param), non_blocking=_pinned(local))
            host.grad = buffer
            stepped.add(index)
            devices.add(local.device)
        for device in devices:  # the host reads what the asynchronous copies wrote
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        host_optimizer.step()
        for index, (param, host, _) in enumerate(self._pairs):
            local = _data(param)
            if index in stepped:
                local.copy_(host, non_blocking=_pinned(local))
            self._versions[index] = _version(param)
        return loss

    def _changed(self) -> list[Tensor]:
        """The parameters written in place since this optimizer last wrote them (their host copies are stale)."""
        return [param for (param, _, _), seen in zip(self._pairs, self._versions) if _version(param) != seen]

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, keyed by the positions of the model's parameters."""
        if self._host is not None:
            self._ensure_host()  # parameters replaced before any step: keep the view in step with the groups
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state (local shards, DTensors, on any device) into host memory; hyperparameters into both groups."""
        host_optimizer = self._ensure_host()
        owner = type(self).__name__
        params = [param for param, _, _ in self._pairs]
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"]) for saved, group in zip(groups, self.param_groups)
        ):
            raise ValueError(
                f"{owner}.load_state_dict: the saved parameter groups ({[len(g['params']) for g in groups]}"
                f" parameters) do not match this optimizer's ({[len(g['params']) for g in self.param_groups]})."
            )
        positions = [index for group in groups for index in group["params"]]
        at = dict(zip(positions, params))
        host_device = {position: host.device for position, (_, host, _) in zip(positions, self._pairs)}
        state = {  # on the host (a state dict moved to the GPU, as Accelerate's prepare does, comes back)
            index: {
                key: value.to(host_device[index]) if isinstance(value, Tensor) else value
                for key, value in ((key, _as_local(value, at[index], owner, key)) for key, value in values.items())
            }
            for index, values in state_dict["state"].items()
        }
        implementation = [{key: g[key] for key in _IMPLEMENTATION if key in g} for g in host_optimizer.param_groups]
        host_optimizer.load_state_dict({"state": state, "param_groups": groups})
        for host_group, kept in zip(host_optimizer.param_groups, implementation):
            host_group.update(kept)  # the host's own choice (the fused CPU kernel), not the saved groups'
        for group, saved in zip(self.param_groups, groups):
            group.update((key, value) for key, value in saved.items() if key != "params")


def offload_optimizer(
    optimizer_class: type[Optimizer], params: Iterable[Tensor] | Iterable[dict[str, Any]], **kwargs: Any
) -> HostOffloadOptimizer:
    """``optimizer_class(params, **kwargs)`` with its state and step in host memory (:class:`HostOffloadOptimizer`).

    For a LightningModule's ``configure_optimizers`` or an Accelerate script that builds its own optimizer::

        optimizer = offload_optimizer(torch.optim.AdamW, model.parameters(), lr=1e-5, weight_decay=0.1)
    """
    return HostOffloadOptimizer(params, optimizer_class, **kwargs)
