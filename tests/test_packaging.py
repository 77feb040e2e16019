"""The wheel works alone (issue 46): it carries every shipped file (recipes, the tiny model and data, the real models'
configs, the Slurm batch files, the Accelerate configs) as package data, and installed (not editable) into a fresh
virtualenv it runs ``--version``, ``recipes``, a ``plan`` by id and the demo from a directory outside the clone."""

from __future__ import annotations

import os
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
NOT_SHIPPED = {"recipes/tiny/make_tiny.py"}


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


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: int = 600) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_the_wheel_installed_in_a_fresh_venv_runs_outside_the_clone(tmp_path: Path) -> None:
    """A few minutes: the dependencies are installed from the index into a virtualenv without system packages."""
    wheel = build_wheel(tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(MLFLOW_DISABLE_TELEMETRY="true", HF_UPDATE_DOWNLOAD_COUNTS="false", HF_HUB_OFFLINE="1")
    work = tmp_path / "elsewhere"
    work.mkdir()
    constraints = work / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")  # the CPU build; a bare `torch` could pull a CUDA one
    _run([*pip, "torch==2.13.0"], work, env, timeout=1200)
    _run([*pip, "-c", str(constraints), str(wheel)], work, env, timeout=1200)
    cli = str(venv / "bin" / "lightning-plugins")
    assert _run([cli, "--version"], work, env).strip().endswith(wheel.name.split("-")[1])
    where = _run([cli, "recipes", "--where", "recipes"], work, env).strip()
    assert str(venv) in where and ROOT.as_posix() not in where  # the wheel's own copy, not this clone's
    listing = _run([cli, "recipes"], work, env)
    assert "llama-3.1-8b/lora_1gpu" in listing and "tiny/lora_tp2" in listing
    _run([cli, "plan", "tiny/full_tp2"], work, env)  # by id: the dry run of the shipped recipe
    _run([cli, "plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8", "--no-verify", "--top", "1"], work, env)
    _run([cli, "finetune", "llama-3.1-8b/lora_1gpu", "--print-config"], work, env)
    _run([cli, "tiny", "llama-3.1-8b/lora_1gpu", "--out", str(work / "twin")], work, env)
    demo = _run([cli, "demo", "--max-steps", "30", "--eval-limit", "20", "--out", str(work / "demo")], work, env)
    assert (work / "demo" / "config.json").is_file(), demo
