"""The console script's own surface: ``--version``, ``recipes``, recipes named by id, and help whose examples exist."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from _launch import in_process

from lightning_plugins.cli import EXAMPLES, _parser, main
from lightning_plugins.errors import RecipeError
from lightning_plugins.resources import find_recipe, recipe_ids, recipes_dir

ROOT = Path(__file__).resolve().parents[1]


def _helps(parser: argparse.ArgumentParser):
    yield parser.description or ""
    for action in parser._actions:
        yield action.help or ""
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                yield choice.help or ""
            for sub in action.choices.values():
                yield from _helps(sub)


def test_every_recipe_the_help_names_is_shipped() -> None:
    from lightning_plugins.accelerate.__main__ import main as accelerate_main  # noqa: F401  (its parser is built inside)

    examples = [m for text in _helps(_parser()[0]) for m in re.findall(r"e\.g\. ([\w./\-]+/[\w.\-]+)", text)]
    recipes = [e for e in examples if not e.startswith(("outputs/", "/"))]
    assert set(EXAMPLES.values()) <= set(recipes) and "llama-3.1-8b/full_fsdp8" in recipes  # plan's
    for name in recipes:
        find_recipe(name)


def test_recipes_are_found_by_id_or_path_and_an_unknown_id_names_the_nearest(tmp_path: Path) -> None:
    ids = recipe_ids()
    assert {"llama-3.1-8b/lora_1gpu", "qwen3-30b-a3b/full_ep8", "tiny/lora_tp2"} <= set(ids)
    assert find_recipe("llama-3.1-8b/lora_1gpu") == recipes_dir() / "llama-3.1-8b" / "lora_1gpu.yaml"
    shipped = recipes_dir() / "tiny" / "full_tp2.yaml"
    assert find_recipe("recipes/tiny/full_tp2.yaml").resolve() == shipped.resolve()  # the clone's spelling, anywhere
    own = tmp_path / "mine.yaml"
    own.write_text("model: {path: x}\n")
    assert find_recipe(own) == own
    with pytest.raises(RecipeError, match=r"qwen3-30b-a3b/full_ep8.*lightning-plugins recipes"):
        find_recipe("qwen3-30b-a3b/full_ep")


def test_recipes_lists_every_shipped_id_with_its_hardware(capsys: pytest.CaptureFixture[str]) -> None:
    main(["recipes"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in lines if line and "/" in line.split()[0]}
    assert set(rows) == set(recipe_ids())
    assert re.search(r"4 x 8 H100\s+full", rows["llama-3.1-70b/full_tp8_fsdp4"])
    assert re.search(r"1 x 1 RTX4090\s+qlora", rows["llama-3.1-8b/qlora_1gpu_24gb"])
    assert re.search(r"2 CPU proc\s+lora", rows["tiny/lora_tp2"])
    main(["recipes", "--where", "accelerate_configs"])
    assert Path(capsys.readouterr().out.strip(), "cpu_2proc.yaml").is_file()


def test_version_and_a_recipe_by_id_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m lightning_plugins`` runs the console script (one interpreter start); the recipe ids are resolved
    from another directory by the same ``main`` in this process (``_launch.in_process``: no start and imports each)."""
    proc = subprocess.run([sys.executable, "-m", "lightning_plugins", "--version"], capture_output=True, text=True)
    assert proc.stdout.strip() == f"lightning-plugins {version('lightning_plugins')}"
    monkeypatch.chdir(tmp_path)
    proc = in_process("lightning_plugins", ["finetune", "tiny/full_tp2", "--print-config"])
    assert proc.returncode == 0, proc.stderr
    assert f"path: {recipes_dir() / 'tiny' / 'model'}" in proc.stdout
    proc = in_process("lightning_plugins", ["plan", "llama-3.1-8b/lora_1gp"])
    assert proc.returncode == 2 and "llama-3.1-8b/lora_1gpu" in proc.stderr and "lightning-plugins recipes" in proc.stderr
