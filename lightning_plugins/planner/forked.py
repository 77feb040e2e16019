"""Each call in its own process, forked from a fork server, as many at once as there are cores (the dry run's pool).

A fake process group, DTensor and pipelining keep process-wide state, so every dry-run world needs a
process of its own; forking them from a server that imported the heavy modules once makes that cheap.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any


#: Imported once by the fork server, so that each dry-run process starts without importing them again.
_PRELOAD = ["lightning_plugins.planner.dryrun", "lightning_plugins.parallel", "transformers", "peft"]


def forked(calls: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """``fn(*args)`` of each call, each in its own process, as many at once as there are cores.

    Each fake world starts clean: DTensor and pipelining keep process-wide caches that refer to the process
    groups of the previous world. The processes are forked from a fork server (single-threaded, modules
    preloaded), never from the caller: forking a process that runs threads (a test runner after gloo worlds,
    a notebook) can leave a child waiting forever on a lock another thread held.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    results: list[Any] = [None] * len(calls)
    width = max(1, min(len(calls), os.cpu_count() or 1))
    pending, running = list(range(len(calls)))[::-1], {}
    while pending or running:
        while pending and len(running) < width:  # a new process as soon as one ends
            index = pending.pop()
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_child_main, args=(send, *calls[index]))
            with _main_not_reimported():
                child.start()
            send.close()
            running[receive] = (index, child)
        for receive in multiprocessing.connection.wait(list(running)):
            index, child = running.pop(receive)
            try:
                ok, value = receive.recv()
            except EOFError:
                ok, value = False, None
            child.join()
            if not ok:
                for _, other in running.values():
                    other.kill()
                    other.join()
                value = value or f"the dry-run process died (exit code {child.exitcode})"
                raise RuntimeError(f"dry run of rank {calls[index][1][-1]} failed:\n{value}")
            results[index] = value
    return results


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Start a process without it importing the caller's ``__main__`` (what it runs lives in this module): a
    script that calls :func:`dry_run` needs no ``if __name__ == "__main__":`` guard."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)


def _child_main(send: Any, fn: Callable[..., Any], args: tuple) -> None:
    try:
        send.send((True, fn(*args)))
    except BaseException:  # report everything to the parent, which raises it with the rank named
        send.send((False, traceback.format_exc()))
    finally:
        send.close()
