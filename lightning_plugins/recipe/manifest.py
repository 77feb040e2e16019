"""``output_dir/run.json``: what exactly a run did, one entry per attempt, so its whole history is recoverable.

Each attempt (a resumed run adds one; the earlier ones stay) records the resolved recipe, the installed versions
(torch, CUDA and NCCL when present, transformers, peft, lightning, accelerate, datasets, this project and its git
commit when it runs from a checkout), the world size and every rank's host, the launch command, a sha256 of each
local data file the recipe names (a hub dataset: its id) and when it started. Rank 0 writes it, atomically, once the
process group is up; every exported directory (``hf/``, ``adapter/``, ``merged/``) carries a copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_plugins.recipe.schema import Recipe

MANIFEST = "run.json"
PACKAGES = ("torch", "transformers", "peft", "lightning", "accelerate", "datasets", "lightning_plugins")


def write_manifest(recipe: Recipe) -> Path | None:
    """Add this attempt to ``output_dir/run.json``; called by every rank (the hosts are gathered from each).

    Returns:
        The file on global rank 0; ``None`` elsewhere.
    """
    ranks = dist.is_available() and dist.is_initialized()
    hosts: list[Any] = [socket.gethostname()]
    if ranks:
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
    if ranks and dist.get_rank() != 0:
        return None
    path = Path(recipe.train.output_dir) / MANIFEST
    attempts = json.loads(path.read_text())["attempts"] if path.is_file() else []
    attempts.append(
        {
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": list(sys.orig_argv),
            "launcher": _launcher(),
            "world_size": len(hosts),
            "hosts": hosts,
            "versions": versions(),
            "git": _git(Path(__file__).resolve().parents[2]),  # the checkout: lightning_plugins/recipe/manifest.py
            "data": {key: data_record(getattr(recipe.data, key)) for key in ("train", "eval")
                     if getattr(recipe.data, key) is not None},  # fmt: skip
            "recipe": json.loads(recipe.model_dump_json()),
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{MANIFEST}.partial")
    partial.write_text(json.dumps({"attempts": attempts}, indent=2) + "\n")
    os.replace(partial, path)
    return path


def attach_manifest(output_dir: str | Path, exported: Iterable[str | Path]) -> None:
    """Copy ``output_dir/run.json`` into each exported directory (rank 0, after the exports)."""
    source = Path(output_dir) / MANIFEST
    for target in exported:
        if Path(target).is_dir():
            shutil.copyfile(source, Path(target) / MANIFEST)


def versions() -> dict[str, str | None]:
    """The installed versions (``None``: not installed); CUDA and NCCL's when a GPU is present."""
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    if torch.cuda.is_available():
        found["cuda"] = torch.version.cuda
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return found


def data_record(source: str) -> dict[str, Any]:
    """A local file's sha256 (a ``save_to_disk`` directory: each file's), or a hub dataset's id."""
    path = Path(source)
    if path.is_file():
        return {"path": str(path), "sha256": _sha256(path)}
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"path": str(path), "sha256": {str(p.relative_to(path)): _sha256(p) for p in files}}
    return {"hub": source}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _launcher() -> list[str] | None:
    """The launcher's command line (``accelerate launch ...``, ``torchrun ...``) when one started this worker."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:  # not Linux
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _git(root: Path) -> dict[str, Any] | None:
    """The commit of the checkout this project runs from and whether its tracked files differ from it."""
    if not (root / ".git").exists():
        return None

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout

    try:
        return {"commit": git("rev-parse", "HEAD").strip(), "dirty": bool(git("status", "--porcelain", "-uno").strip())}
    except (OSError, subprocess.CalledProcessError):
        return None
