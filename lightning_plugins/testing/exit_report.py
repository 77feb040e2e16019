"""Imported by the test scripts (and the test helpers): at the very end of a process's exit handlers, report the
process-group threads still alive.

A gloo process group's worker threads that are still running while the interpreter finalizes can take the GIL then
and abort the process (see :mod:`lightning_plugins.parallel.teardown`); the doors release the groups from an exit handler.
This module registers its own handler when it is imported, before any door registers one (handlers run in reverse
order), so it runs after them; it writes ``<$LIGHTNING_PLUGINS_TEST_EXIT_REPORTS>/<pid>.txt`` with the names of the
live threads, one per line, which the launching test reads (:func:`read_exit_reports`).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

#: The directory, set by the test that launches the process, where each process writes its report.
EXIT_REPORTS = "LIGHTNING_PLUGINS_TEST_EXIT_REPORTS"
#: Thread names of torch's process groups: gloo's workers and its transport loop, the TCP store's server.
_BACKEND_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def backend_threads() -> list[str]:
    """The names of this process's live threads that belong to a process group (Linux: ``/proc``)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in _BACKEND_THREADS:
            names.append(name)
    return sorted(names)


def read_exit_reports(folder: str | Path) -> dict[str, list[str]]:
    """``pid -> live process-group threads`` for every process that reported one or more."""
    reports = {path.stem: path.read_text().split() for path in Path(folder).glob("*.txt")}
    return {pid: names for pid, names in reports.items() if names}


def _report() -> None:
    folder = os.environ.get(EXIT_REPORTS)
    if folder and Path(folder).is_dir():
        Path(folder, f"{os.getpid()}.txt").write_text("\n".join(backend_threads()))


atexit.register(_report)
