"""The documentation (issue 46): the site builds with ``mkdocs build --strict`` (broken links and anchors fail), the
recipe reference covers every key of the schema, the gallery every shipped recipe with its planned figures, the API
reference and the benchmark results are pages, the tested-versions table agrees with ``.ci/floors.txt`` and the
pyproject's bounds, every recipe a command in the README or the docs names is shipped, and the README stays a few
screens that link into the site, its Python snippets running against the package."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _hook(name: str = "recipe_keys"):
    spec = importlib.util.spec_from_file_location(name, DOCS / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_recipe_key_is_documented() -> None:
    hook = _hook()
    assert hook.undocumented() == [], "describe these keys in a docstring under each field"
    reference = hook.reference()
    for prefix, _ in hook.sections():
        assert f"### `{prefix}`" in reference
    assert reference.count("\n| `") >= 89  # the 89 keys issue 46 counted, and those added since
    for key in ("model.trust_remote_code", "train.profile.start_step", "memory.optimizer_offload", "layout.ep_size"):
        assert f"| `{key}` |" in reference


def test_the_site_builds_strict(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = (tmp_path / "recipe-reference" / "index.html").read_text()
    assert "train.max_steps" in reference and "{{ recipe_keys }}" not in reference
    gallery = (tmp_path / "gallery" / "index.html").read_text()
    assert "llama-3.1-70b/lora_fsdp8" in gallery and "{{ recipe_gallery }}" not in gallery
    assert (tmp_path / "gallery-memory.png").read_bytes().startswith(b"\x89PNG")  # drawn from the recipe table
    api = (tmp_path / "api" / "index.html").read_text()
    assert 'id="lightning_plugins.' in api
    for name in ("parallelize", "ParallelLayout", "TensorParallelStrategy", "ParallelAccelerator", "load_recipe"):
        assert name in api
    results = (tmp_path / "benchmarks" / "index.html").read_text()
    first = (ROOT / "benchmarks" / "RESULTS.md").read_text().split("\n## ", 1)[1].splitlines()[0]
    assert first.split(":")[0] in results  # benchmarks/RESULTS.md, read when the site is built


def test_the_gallery_shows_every_shipped_recipe_with_its_planned_figures() -> None:
    from lightning_plugins.resources import recipe_ids

    gallery = _hook("gallery")
    rows = {row["id"]: row for row in gallery.recipes()}
    assert sorted(rows) == recipe_ids()
    real = [name for name in rows if not name.startswith("tiny/")]
    assert len(real) >= 40
    missing = [name for name in real if not rows[name]["peak"] or not rows[name]["rate"]]
    assert not missing, f"no planned peak / tok/s in docs/recipes.md's recipe table for {missing}"
    assert rows["llama-3.1-70b/lora_fsdp8"]["hardware"] == "1 x 8 H100"
    assert rows["llama-3.1-70b/qlora_1gpu"]["method"] == "qlora"
    assert "| `llama-3.1-70b/lora_fsdp8` | `meta-llama/Llama-3.1-70B` | lora r=16 |" in gallery.gallery()


def test_the_tested_versions_table_agrees_with_the_floors_and_the_caps() -> None:
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    floors = dict(line.strip().split("==") for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines()
                  if "==" in line and not line.startswith("#"))  # fmt: skip
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra in project["optional-dependencies"].values() for r in extra if "lightning_plugins" not in r]
    declared = {}
    for text in [*project["dependencies"], *extras]:
        requirement = Requirement(text)
        declared[requirement.name] = requirement.specifier
    table = re.findall(r"^\| `([\w.-]+)` \| ([\w.]+) \| (<[\w.]+|-) \| ([^|]+) \|$", (DOCS / "versions.md").read_text(), re.M)
    assert {name for name, *_ in table} == set(floors), "one row per package .ci/floors.txt pins"
    for name, floor, cap, newest in table:
        specifier = declared[name]
        assert floor == floors[name], f"{name}: the table's lower bound {floor}, .ci/floors.txt {floors[name]}"
        lower = [s.version for s in specifier if s.operator == ">="]
        assert lower and Version(lower[0]) == Version(floor), f"{name}: pyproject.toml's lower bound is {specifier}"
        upper = [s.version for s in specifier if s.operator == "<"]
        assert cap == (f"<{upper[0]}" if upper else "-"), f"{name}: pyproject.toml's upper bound is {specifier}"
        for version in re.findall(r"\d+(?:\.\d+)+", newest):
            assert Version(version) in specifier, f"{name}: the newest tested {version} is outside {specifier}"


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


#: What the README's Python snippets take as given: the user's module, model, optimizer and loader (a tiny Llama).
PRELUDE = """
import sys
sys.path.insert(0, {tests!r})
import torch
import lightning as L
from torch.utils.data import DataLoader
from tiny_models import make_batch, tiny_model


class Module(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


model = tiny_model("llama")
module = Module(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batch = make_batch(8, 16, model.config.vocab_size, 0)
loader = DataLoader([{{k: v[i] for k, v in batch.items()}} for i in range(8)], batch_size=4)
"""
ACCELERATE_STEP = """
for batch in loader:
    accelerator.backward(model(**batch).loss)
    optimizer.step()
    optimizer.zero_grad()
print("accelerate snippet ran", accelerator.process_index)
"""


def test_the_readme_python_snippets_run(tmp_path: Path) -> None:
    """The Lightning snippet as written (4 CPU processes, TP=2), the Accelerate one under torchrun (2 processes)."""
    from lightning_plugins.testing.world import free_port

    snippets = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (lightning,) = [s for s in snippets if "L.Trainer(" in s]
    (accelerate,) = [s for s in snippets if "ParallelAccelerator(" in s]
    prelude = PRELUDE.format(tests=str(ROOT / "tests"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MASTER_PORT": str(free_port())}
    script = tmp_path / "readme_lightning.py"
    script.write_text(prelude + lightning + "\nassert trainer.global_step == 20, trainer.global_step\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    script = tmp_path / "readme_accelerate.py"
    script.write_text(prelude + accelerate + ACCELERATE_STEP)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}"]
    proc = subprocess.run([*torchrun, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("accelerate snippet ran") == 2
