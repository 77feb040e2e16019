"""What one training step costs a rank, counted from inside the step: the bytes its collectives send on the wire
(:class:`CommCounter`, a ``TorchDispatchMode``; :func:`wire_bytes` with ring algorithms), the bytes of the state it
starts from (:func:`state_bytes`) and the peak of the bytes it allocates (:func:`peak_step_allocation`, from the
profiler's allocation events: torch has no allocator statistics on CPU). ``benchmarks/tensor_parallel.py``,
``benchmarks/doors.py`` and ``benchmarks/finetune_methods.py`` measure with them."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------------- communication


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_size(args: tuple, kwargs: dict) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    for value in list(args) + list(kwargs.values()):
        if isinstance(value, str):
            with contextlib.suppress(Exception):
                return _resolve_process_group(value).size()
        if hasattr(value, "size") and not isinstance(value, torch.Tensor) and callable(value.size):
            with contextlib.suppress(Exception):
                return int(value.size())
    return dist.get_world_size() if dist.is_initialized() else 1


# "namespace.op" -> (collective kind, payload = bytes of the full, unsharded tensor from (args, group size))
_COLLECTIVES: dict[str, tuple[str, Callable[[tuple, int], int]]] = {
    # functional collectives (DTensor)
    "_c10d_functional.all_reduce": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "_c10d_functional.all_reduce_": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "_c10d_functional.all_reduce_coalesced_": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", lambda a, n: _nbytes(a[0]) * n),
    "_c10d_functional.all_gather_into_tensor_out": ("all_gather", lambda a, n: _nbytes(a[0]) * n),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", lambda a, n: _nbytes(a[0]) * n),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", lambda a, n: _nbytes(a[0])),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a, n: _nbytes(a[0])),
    "_c10d_functional.all_to_all_single": ("all_to_all", lambda a, n: _nbytes(a[0])),
    "_c10d_functional.broadcast": ("broadcast", lambda a, n: _nbytes(a[0])),
    "_c10d_functional.broadcast_": ("broadcast", lambda a, n: _nbytes(a[0])),
    # in-place c10d ops behind torch.distributed.* (and gloo-backed Python code)
    "c10d.allreduce_": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "c10d.allreduce_coalesced_": ("all_reduce", lambda a, n: _nbytes(a[0])),
    "c10d._allgather_base_": ("all_gather", lambda a, n: _nbytes(a[0])),
    "c10d.allgather_": ("all_gather", lambda a, n: _nbytes(a[0])),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", lambda a, n: _nbytes(a[0])),
    "c10d._reduce_scatter_base_": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "c10d.reduce_scatter_": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a, n: _nbytes(a[1])),
    "c10d.alltoall_base_": ("all_to_all", lambda a, n: _nbytes(a[1])),
    "c10d.alltoall_": ("all_to_all", lambda a, n: _nbytes(a[1])),
    "c10d.broadcast_": ("broadcast", lambda a, n: _nbytes(a[0])),
    "c10d.reduce_": ("reduce", lambda a, n: _nbytes(a[0])),
    "c10d.scatter_": ("scatter", lambda a, n: _nbytes(a[0])),
    "c10d.gather_": ("gather", lambda a, n: _nbytes(a[1])),
    "c10d.send": ("send", lambda a, n: _nbytes(a[0])),
    "c10d.recv_": ("recv", lambda a, n: 0),
    "c10d.barrier": ("barrier", lambda a, n: 0),
}
_NOT_COMMUNICATION = {"wait_tensor", "_wrap_tensor_autograd", "monitored_barrier_"}


def wire_bytes(kind: str, payload: int, n: int) -> float:
    """Bytes one rank sends for a collective over ``n`` ranks with ring algorithms (``payload`` = full size)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n * payload
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n * payload
    return float(payload)


class CommCounter:
    """A ``TorchDispatchMode`` that records every collective with its shape and size."""

    def __init__(self) -> None:
        from torch.distributed.tensor import DTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.records: list[dict[str, Any]] = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                # Let DTensor desugar first, so its collectives come back through this mode.
                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented
                ns = func.namespace
                if ns.startswith("_c10d_functional") or ns == "c10d":
                    counter._record(func, args, kwargs)
                return func(*args, **kwargs)

        self.mode = _Mode()

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = f"{func.namespace}.{func._opname}"
        if func._opname in _NOT_COMMUNICATION:
            return
        kind, payload_of = _COLLECTIVES.get(name, ("UNKNOWN:" + name, lambda a, n: _nbytes(a)))
        n = _group_size(args, kwargs)
        payload = payload_of(args, n)
        first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
        shape = list(first.shape) if isinstance(first, torch.Tensor) else []
        self.records.append(
            {"op": name, "kind": kind, "n": n, "payload": payload, "wire": wire_bytes(kind, payload, n), "shape": shape}
        )


# ------------------------------------------------------------------------------------------------------------ memory


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind parameters, buffers, gradients and optimizer state."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return sum(seen.values())


def peak_step_allocation(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` under the profiler; return its result and the peak of bytes allocated during it."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.alloc_size, fields.ptr))
        stack.extend(event.children)
    events.sort(key=lambda e: e[0])
    live: dict[int, int] = {}
    current = peak = 0
    for _, size, ptr in events:
        if size > 0:
            live[ptr] = size
            current += size
        elif ptr in live:  # only frees of blocks this step allocated
            current -= live.pop(ptr)
        peak = max(peak, current)
    return result, peak
