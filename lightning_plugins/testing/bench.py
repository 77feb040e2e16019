"""What the benchmark scripts share: their common options (``--threads``, ``--out``, ``--output``, ``--json``), the
run's wall time and load, the command and machine lines, the report (the command, then the table), and what they write
(the report as Markdown, the rows or measurements as JSON)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch


def add_world_arguments(parser: argparse.ArgumentParser, *, out: bool = True) -> None:
    """``--threads`` (torch threads per rank) and, with ``out``, ``--out`` (the rows as JSON)."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    if out:
        parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")


class Timed:
    """``with Timed() as run:``: the wall time of the block (``run.elapsed``, seconds) and the 1-minute load average
    at its start and end (``run.load``): the machine is shared, so a report says how busy it was."""

    def __enter__(self) -> Timed:
        self.start, self.load_start = time.perf_counter(), os.getloadavg()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed, self.load = time.perf_counter() - self.start, (self.load_start, os.getloadavg()[0])


def add_report_arguments(
    parser: argparse.ArgumentParser, *, output: bool = False, json_out: bool = False, out: bool = False,
    out_default: str | None = None,
) -> None:
    """The options that say where a report goes besides the console: ``--output`` (the Markdown report), ``--json``
    (the raw measurements) and ``--out`` (the rows as JSON; ``out_default``: a file written unless told otherwise)."""
    if output:
        parser.add_argument("--output", type=Path, default=None, help="also write the markdown report here")
    if json_out:
        parser.add_argument("--json", type=Path, default=None, help="also write the raw measurements as JSON here")
    if out:
        default = None if out_default is None else Path(out_default)
        parser.add_argument("--out", type=Path, default=default, help="also write the rows as JSON here")


def command(argv: list[str] | None = None) -> str:
    """The command that ran the script, as one types it (``python benchmarks/x.py --quick``); ``argv``: the arguments
    given to its ``main`` instead of the command line's."""
    return "python " + " ".join([os.path.relpath(sys.argv[0]), *(sys.argv[1:] if argv is None else argv)])


def machine(
    load: tuple[float, float] | None = None, *, packages: tuple[str, ...] = (), python: bool = False,
    backend: str = "gloo",
) -> str:
    """The processor, its cores, torch's version and the ``backend`` (with a GPU's name, say); the ``packages``'
    versions and Python's when asked; with ``load``, the load average at the start and the end of the run."""
    text = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, {backend}"
    text += "".join(f", {name} {_version(name)}" for name in packages)
    text += f", Python {platform.python_version()}" if python else ""
    return text if load is None else f"{text}; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def print_report(table: str, elapsed: float, on: str) -> None:
    """The command line, how long it ran and ``on`` what machine, then the table."""
    print_run(elapsed, on)
    print(table)


def print_run(elapsed: float, on: str) -> None:
    """The command line, how long it ran and ``on`` what machine (after a table printed a row at a time)."""
    print(f"\n{' '.join(sys.argv)}  ({elapsed:.0f} s; {on})\n", flush=True)


def write_rows(
    out: Path | None, args: argparse.Namespace, on: str, rows: list[dict[str, Any]] | dict[str, Any]
) -> None:
    """The options, the machine and the rows as JSON in ``out`` (nothing when ``out`` is ``None``)."""
    if out is not None:
        record = {"args": vars(args) | {"out": str(out)}, "machine": on, "rows": rows}
        out.write_text(json.dumps(record, indent=1))


def write_report(path: Path | None, text: str) -> None:
    """The Markdown report in ``path`` (nothing when ``path`` is ``None``)."""
    if path is not None:
        Path(path).write_text(text + "\n")


def write_json(
    path: Path | str | None, data: Any, indent: int | None = 1, default: Callable[[Any], Any] | None = None
) -> None:
    """``data`` as JSON in ``path`` (nothing when ``path`` is ``None``); ``default`` turns what JSON cannot hold into
    what it can (``str``, say)."""
    if path is not None:
        Path(path).write_text(json.dumps(data, indent=indent, default=default))
