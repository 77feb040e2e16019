"""Process groups released while the interpreter is alive, framework-free: both doors end every process this way.

Why. A gloo process group runs each collective on one of its worker threads, and the worker keeps the finished
collective (and its tensors) until it is scheduled again. When the Python side has already dropped such a tensor,
the worker's release is the last one and takes the GIL to free the tensor's Python object. A process that ends
without destroying its process groups leaves those threads running while the interpreter finalizes; a worker that
asks for the GIL then is ended by Python inside C++ code that cannot unwind, and the process aborts
(``terminate called without an active exception``, exit code 134) or dies of SIGSEGV after the run finished. A loaded
machine makes it likely: the worker waits for a CPU while the main thread reaches the interpreter's exit.

:func:`release_process_groups` destroys the process groups and frees what held them while the interpreter is still
whole: a destructed gloo group waits for its workers (they may take the GIL then), so none is left to race the
finalization. :func:`release_at_exit` runs it when the interpreter exits; the doors register it when they join the
process group, because the user's script may still run collectives after ``fit`` (or after the Accelerate loop).
"""

from __future__ import annotations

import atexit
import gc
import sys
import types
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["release_at_exit", "release_process_groups", "track_mesh"]

#: Meshes built by the engine (:meth:`~lightning_plugins.ParallelLayout.build_mesh`), by identity: meshes of the same
#: shape compare equal, so a set would keep one of them. See :func:`track_mesh`.
_MESHES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_registered = False


def track_mesh(mesh: Any) -> Any:
    """Remember ``mesh`` so that :func:`release_process_groups` drops the groups it caches; returns ``mesh``.

    A ``DeviceMesh`` keeps a reference to every process group of its dimensions (and of those of its sub- and
    flattened meshes), and every DTensor of a parallelized model keeps its mesh: a model the script still holds at
    exit would otherwise keep its groups, and their threads, alive into the interpreter's finalization.
    """
    _MESHES[id(mesh)] = mesh
    return mesh


def release_process_groups() -> int:
    """Destroy every process group of this process and free them, with their threads.

    After it no collective can run (as after ``torch.distributed.destroy_process_group``), and the objects that still
    referred to a destroyed group (a model the script keeps: FSDP2's mesh information, a pipeline stage, a mesh's
    cache) refer to ``None`` instead, so that nothing keeps the group alive. It does nothing when no process group
    exists.

    Returns:
        How many of the destroyed process groups are still alive (held where Python cannot see it, e.g. by C++).
    """
    groups: list[weakref.ref] = []
    if dist.is_available() and dist.is_initialized():
        groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_names]
        dist.destroy_process_group()
    for mesh in list(_MESHES.values()):
        registry = getattr(mesh, "_pg_registry", None)  # torch's cache of the mesh's groups (by name)
        if isinstance(registry, dict):
            registry.clear()
    _forget_deepspeed_defaults()
    if groups:
        # Garbage in reference cycles (a finished run's model, trainer) goes now, not in the interpreter's finalization:
        # it may hold a group, or only what keeps a destroyed group's transport and its thread alive (a collective's
        # work object holds the gloo context, whose device runs the ``gloo_tcp_loop`` thread).
        gc.collect()
    for ref in groups:
        group = ref()
        if group is not None:
            _let_go(group)
            del group
    return sum(ref() is not None for ref in groups)


def _let_go(group: dist.ProcessGroup) -> None:
    """Point the references the program still holds to the destroyed ``group`` at ``None`` (it can serve no
    collective any more): attributes, dictionary values, list items, closure cells.

    Plain loops only: a comprehension that named ``group`` would make it a closure cell of this function (Python
    3.11), which the loop would then find among the holders and empty.
    """
    for holder in gc.get_referrers(group):
        if isinstance(holder, types.CellType):
            holder.cell_contents = None
            continue
        if isinstance(holder, list):
            for index, value in enumerate(holder):
                if value is group:
                    holder[index] = None
            continue
        if not isinstance(holder, dict):
            if isinstance(holder, type) or not isinstance(getattr(holder, "__dict__", None), dict):
                continue
            holder = vars(holder)
        elif any(isinstance(owner, type) for owner in gc.get_referrers(holder)):
            continue  # a class's namespace: writing it directly would bypass the type's attribute cache
        for key, value in list(holder.items()):
            if value is group:
                holder[key] = None


def _forget_deepspeed_defaults() -> None:
    """DeepSpeed's comm backend, when imported after the process group exists, keeps the default group in default
    arguments (deepspeed 0.19: ``TorchBackend.barrier(group=GroupMember.WORLD)``, ``monitored_barrier``), which read
    ``None`` as that group anyway. transformers' ``save_pretrained`` imports it (through Accelerate) whenever it is
    installed, so an export would keep the default group, and its threads, alive."""
    backend = getattr(sys.modules.get("deepspeed.comm.torch"), "TorchBackend", None)
    for function in vars(backend).values() if backend is not None else ():
        defaults = getattr(function, "__defaults__", None)
        if defaults and any(isinstance(value, dist.ProcessGroup) for value in defaults):
            function.__defaults__ = tuple(None if isinstance(value, dist.ProcessGroup) else value for value in defaults)


def release_at_exit() -> None:
    """Run :func:`release_process_groups` when the interpreter exits (registered once per process).

    ``atexit`` runs it before the interpreter starts finalizing, after the handlers registered later (the script's own)
    and after ``threading`` has joined its non-daemon threads (e.g. an asynchronous checkpoint's writer).
    """
    global _registered
    if not _registered:
        atexit.register(release_process_groups)
        _registered = True
