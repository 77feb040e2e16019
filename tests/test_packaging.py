"""The wheel works alone (issue 46): it carries every shipped file (recipes, the tiny model and data, the real models'
configs, the Slurm batch files, the Accelerate configs) as package data (fast: the wheel's listing). Installed (not
editable) into a fresh virtualenv it runs from a directory outside the clone: that is ``.ci/wheel``, which CI runs and
the slow test here runs too."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Repository folder -> where the wheel puts it.
MAPPED = {"recipes": "lightning_plugins/recipes", "accelerate_configs": "lightning_plugins/accelerate_configs"}
#: Shipped files the wheel leaves out: the tiny assets' generator (a clone's tool; its outputs ship).
NOT_SHIPPED = {"recipes/tiny/make_tiny.py", "recipes/tiny/make_tiny_vlm.py", "recipes/tiny/make_tiny_qwen_vl.py"}


def _source_files() -> list[str]:
    """The files a clone would have: tracked, plus new ones git does not ignore (paths relative to the root)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    return [line for line in listed.stdout.splitlines() if (ROOT / line).is_file()]


def build_wheel(out: Path) -> Path:
    """The wheel built from a copy of the clone's files (the build writes build/ and egg-info where it runs)."""
    source = out / "src"
    for name in _source_files():
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / name).read_bytes())
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", str(source), "-w", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = out.glob("lightning_plugins-*.whl")
    return wheel


def test_every_package_is_listed() -> None:
    from setuptools import find_packages

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    found = find_packages(str(ROOT), include=["lightning_plugins*"])
    mapped = [name.replace("/", ".") for name in MAPPED.values()]
    assert sorted(listed) == sorted(found + mapped), "list every package in pyproject.toml [tool.setuptools] packages"


def test_the_wheel_carries_every_shipped_file(tmp_path: Path) -> None:
    wheel = zipfile.ZipFile(build_wheel(tmp_path))
    names = set(wheel.namelist())
    shipped = [f for f in _source_files() if f.split("/")[0] in MAPPED and f not in NOT_SHIPPED]
    assert len(shipped) > 80
    missing = [f for f in shipped if f"{MAPPED[f.split('/')[0]]}/{f.split('/', 1)[1]}" not in names]
    assert not missing, f"not in the wheel (add their kind to [tool.setuptools.package-data]): {missing}"
    modules = {f for f in _source_files() if f.startswith("lightning_plugins/") and f.endswith(".py")}
    assert modules <= names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = wheel.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text and "Provides-Extra: docs" in text


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_venv_runs_outside_the_clone() -> None:
    """``.ci/wheel``, which CI runs (``.ci/run``): the wheel installed into a fresh virtualenv runs ``--version``,
    ``recipes``, ``plan`` / ``finetune --print-config`` / ``tiny`` by id and the demo from an empty directory outside the
    clone; the launchers' jobs against their schemas, ``twine check`` and ``mkdocs build --strict``. Several minutes,
    most of it installing from the index."""
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "wheel")], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
