"""What the benchmark scripts that time worlds share: their common options, the run's wall time and load, the
machine line and the report (the command, then the table), and the rows written as JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
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


def machine(load: tuple[float, float] | None = None) -> str:
    """The processor, its cores, torch's version and the backend; with ``load``, the load average at the start and
    the end of the run."""
    text = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo"
    return text if load is None else f"{text}; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"


def print_report(table: str, elapsed: float, on: str) -> None:
    """The command line, how long it ran and ``on`` what machine, then the table."""
    print(f"\n{' '.join(sys.argv)}  ({elapsed:.0f} s; {on})\n")
    print(table)


def write_rows(out: Path | None, args: argparse.Namespace, on: str, rows: list[dict[str, Any]]) -> None:
    """The options, the machine and the rows as JSON in ``out`` (nothing when ``out`` is ``None``)."""
    if out is not None:
        record = {"args": vars(args) | {"out": str(out)}, "machine": on, "rows": rows}
        out.write_text(json.dumps(record, indent=1))
