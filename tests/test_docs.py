"""The documentation (issue 46): the site builds with ``mkdocs build --strict`` (broken links and anchors fail), the
recipe reference covers every key of the schema, every recipe a command in the README or the docs names is shipped,
and the README stays a few screens that link into the site."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _hook():
    spec = importlib.util.spec_from_file_location("recipe_keys", DOCS / "hooks" / "recipe_keys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_recipe_key_is_documented() -> None:
    hook = _hook()
    assert hook.undocumented() == [], "describe these keys in their section class's Attributes:/Args: docstring"
    reference = hook.reference()
    for prefix, _ in hook.sections():
        assert f"### `{prefix}`" in reference
    assert reference.count("\n| `") >= 89  # the 89 keys issue 46 counted, and those added since
    for key in ("model.trust_remote_code", "train.profile.start_step", "memory.optimizer_offload", "layout.ep_size"):
        assert f"| `{key}` |" in reference


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason='mkdocs is not installed: pip install -e ".[docs]"')
def test_the_site_builds_strict(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = (tmp_path / "recipe-reference" / "index.html").read_text()
    assert "train.max_steps" in reference and "{{ recipe_keys }}" not in reference


def _named_recipes(text: str) -> set[str]:
    """The recipes that commands in ``text`` name (placeholders, written files and options left out)."""
    found = re.findall(r"lightning-plugins (?:finetune|plan|tiny|launch) ([^\s`]+)", text)
    found += re.findall(r"-m lightning_plugins\.accelerate ([^\s`]+)", text)
    found += re.findall(r"sbatch --nodes=\d+ \S+ +([^\s`]+)", text)
    return {n for n in found if not n.startswith(("-", "outputs/", "$", '"')) and not n.isupper() and n != "RECIPE.yaml"}


def test_every_recipe_the_docs_name_is_shipped() -> None:
    from lightning_plugins.resources import find_recipe

    pages = [README, *sorted(DOCS.glob("*.md"))]
    named = {name: page.name for page in pages for name in _named_recipes(page.read_text())}
    assert len(named) >= 6
    for name, page in named.items():
        find_recipe(ROOT / name if name.startswith("recipes/") else name)  # raises, naming the nearest ids


def test_the_readme_is_a_few_screens_that_link_into_the_docs() -> None:
    text = README.read_text()
    assert len(text.encode()) < 12_000 and len(text.splitlines()) < 150
    # The two quickstart commands (CI runs the second: .ci/run).
    assert 'pip install "torch==2.13.0" -e ".[test]" && python -m lightning_plugins demo\npython -m pytest -q\n' in text
    assert "hf auth login" in text and "lightning-plugins finetune llama-3.1-70b/lora_fsdp8" in text
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(set(links)) >= 10
    assert all((ROOT / link).is_file() for link in links), [link for link in links if not (ROOT / link).is_file()]
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(page.name in nav for page in DOCS.glob("*.md")), "every page is in mkdocs.yml's nav"
