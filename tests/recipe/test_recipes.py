"""The shipped real-size recipes (``recipes/<model>/*.yaml``): each validates offline against its model's shipped
config, fits the hardware it names at real size (the planner's dry run, 10% margin), is listed in the docs with
the memory the planner predicts, and trains tiny (``lightning-plugins tiny``) through both doors with a falling loss.
"""

from __future__ import annotations

import csv
import hashlib
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from lightning_plugins.testing.world import free_port, run_command
from _launch import ROOT, clean_stdout

from lightning_plugins.planner.report import plan_recipes
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.recipe.tiny import MAX_TINY_WORLD, shrink_recipe, tiny_layout

RECIPES = sorted(p for p in (ROOT / "recipes").glob("*/*.yaml") if p.parent.name != "tiny")
NAMES = [f"{p.parent.name}/{p.stem}" for p in RECIPES]
STEPS = 6
GIB = 2**30


def test_the_recipes_the_issue_asks_for_are_shipped() -> None:
    methods = {name.split("/")[0]: {stem.split("_")[0] for stem in [n.split("/")[1] for n in NAMES if n.startswith(name.split("/")[0] + "/")]} for name in NAMES}  # fmt: skip
    for model in ("llama-3.1-8b", "mistral-7b-v0.3", "qwen2.5-7b", "llama-3.1-70b", "qwen2.5-72b"):
        assert {"full", "lora", "qlora"} <= methods[model], model
    for model in ("qwen2.5-14b", "qwen2.5-32b", "qwen3-32b", "phi-4", "gemma-3-27b"):  # Phi-4, Gemma 3: issue 27
        assert {"full", "lora"} <= methods[model], model
    assert {"full", "lora", "qlora"} <= methods["llama-3.1-405b"]
    for model in ("qwen3-30b-a3b", "qwen3-235b-a22b"):  # mixture of experts (issue 26)
        assert {"full", "lora"} <= methods[model], model
    for model in ("mixtral-8x22b-v0.1", "gpt-oss-120b"):
        assert "lora" in methods[model], model
    # The 2026 families (issue 47): Qwen3.5 dense and MoE (full and LoRA), DeepSeek-V3 over several nodes with expert
    # parallelism, GLM-4.5-Air, gpt-oss-20b on one GPU.
    for model in ("qwen3.5-27b", "qwen3.5-35b-a3b"):
        assert {"full", "lora"} <= methods[model], model
    assert "lora" in methods["glm-4.5-air"]
    [deepseek] = [load_recipe(p) for p in RECIPES if p.parent.name == "deepseek-v3"]
    assert deepseek.hardware.nodes > 1 and deepseek.layout.ep_size > deepseek.hardware.devices
    [small] = [load_recipe(p) for p in RECIPES if p.parent.name == "gpt-oss-20b"]
    assert small.hardware.world_size == 1
    moe = [load_recipe(p) for p in RECIPES if p.parent.name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x22b-v0.1", "gpt-oss-120b", "qwen3.5-35b-a3b", "deepseek-v3", "glm-4.5-air", "gpt-oss-20b", "qwen3-vl-30b-a3b")]  # fmt: skip
    assert all(r.layout.ep_size > 1 for r in moe if r.hardware.world_size > 1)
    assert all(r.lora.target_modules for r in moe if r.lora is not None)  # attention: expert LoRA is not assumed
    # Preference fine-tuning (issue 49): DPO with LoRA (the reference: the base, adapters off) on 1 GPU, 8 GPUs, and EP.
    dpo = {name: load_recipe(p) for name, p in zip(NAMES, RECIPES) if name.split("/")[1].startswith("dpo")}
    assert {"llama-3.1-8b/dpo_lora_1gpu", "llama-3.1-70b/dpo_lora_fsdp8", "qwen3-30b-a3b/dpo_lora_ep8"} <= set(dpo)
    assert all(r.objective.method == "dpo" and r.lora is not None and r.data.format == "preference" for r in dpo.values())
    long_context = [load_recipe(p) for p in RECIPES if p.stem.endswith("_cp")]
    assert {r.model.path for r in long_context} == {
        "meta-llama/Llama-3.1-70B", "Qwen/Qwen2.5-72B", "google/gemma-3-27b-pt", "Qwen/Qwen2.5-VL-7B-Instruct"
    }  # fmt: skip
    assert all(r.layout.cp_size > 1 and r.data.max_seq_len >= 32768 for r in long_context)
    # Image-text (issue 50): Qwen2.5-VL-7B LoRA on 1 GPU, Qwen3-VL-30B-A3B with EP on 8, Gemma-3-27B full on 8, and a
    # long-document one with CP; each dry-run with images (its vision: section's assumption).
    images = {name: load_recipe(p) for name, p in zip(NAMES, RECIPES) if load_recipe(p).data.format == "image_text"}
    assert {"qwen2.5-vl-7b/lora_1gpu", "qwen3-vl-30b-a3b/lora_ep8", "gemma-3-27b/full_8gpu"} <= set(images)
    assert images["qwen2.5-vl-7b/lora_1gpu"].hardware.world_size == 1
    assert images["qwen3-vl-30b-a3b/lora_ep8"].layout.ep_size == 8 == images["gemma-3-27b/full_8gpu"].hardware.devices
    assert images["gemma-3-27b/full_8gpu"].lora is None
    assert any(r.layout.cp_size > 1 and r.data.max_seq_len >= 32768 for r in images.values())


@pytest.mark.parametrize("path", RECIPES, ids=NAMES)
def test_recipe_validates_against_its_shipped_config(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("# ") and "Why:" in text, f"{path}: the header comment says why this layout"
    recipe = load_recipe(path)
    assert recipe.hardware.world_size == recipe.layout.world_size
    assert recipe.hardware.gpu is not None and recipe.hardware.accelerator == "gpu"
    with pytest.raises(Exception, match="does not divide|not divisible|does not fit"):
        load_recipe(path, ["layout.tp_size=3"])  # the shipped config is really checked: TP=3 divides no model here


def _readme_peaks() -> dict[str, float]:
    """``recipe -> predicted peak GiB`` from the recipe table of the docs (``docs/recipes.md``); where the page has a
    paragraph of other figures for the running torch release ("On torch 2.15 ... `recipe` **29.3** ..."), those."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    rows = re.findall(r"^\| \[?`([\w.\-/]+)`(?:\]\([^)]*\))? \|[^|]*\|[^|]*\|[^|]*\| \*\*([\d.]+)\*\*", text, re.M)  # fmt: skip
    peaks = {name: float(peak) for name, peak in rows}
    release = ".".join(torch.__version__.split(".")[:2])
    paragraph = re.search(rf"^On torch {re.escape(release)}\b.*?\n\n", text, re.M | re.S)
    if paragraph:
        peaks.update({name: float(peak) for name, peak in re.findall(r"`([\w.\-/]+)`\s+\*\*([\d.]+)\*\*", paragraph[0])})
    return peaks


#: Recipes of different kinds of layout and lever, dry-run by the default suite (about 2 minutes): TP x FSDP, CP at
#: 64K, experts (EP8 over FSDP8), QLoRA on one GPU. The slow test dry-runs every recipe (about 14 minutes; pipelines
#: cost most, three kinds of rank each; the 2026 families about 30 more on 2 shared cores: Qwen3.5's linear attention
#: runs transformers' torch reference of the chunked delta rule, 4-10 minutes a recipe, so none is in the sample;
#: tests/planner/test_planner_linear_attention.py checks that measurement against a real run).
SAMPLE = [
    "qwen2.5-14b/full_tp2_fsdp4",
    "llama-3.1-70b/lora_64k_cp",
    "qwen3-30b-a3b/full_ep8",
    "llama-3.1-70b/qlora_1gpu",
]


@pytest.mark.parametrize("names", [SAMPLE, pytest.param(NAMES, marks=pytest.mark.slow)], ids=["sample", "all"])
def test_recipes_fit_their_hardware_at_real_size_as_the_readme_says(names: list[str]) -> None:
    """The planner's dry run of each recipe on the hardware it names: every rank kind within the GPU less 10%, host
    memory within the node's; the docs' recipe table (docs/recipes.md) shows the same peak (0.1 GiB). One test: the dry runs share one
    pool of processes, and a failure lists every recipe that does not fit."""
    readme = _readme_peaks()
    problems = []
    for plan, name in zip(plan_recipes([load_recipe(ROOT / "recipes" / f"{name}.yaml") for name in names]), names):
        peak = plan.peak / GIB
        if not plan.fits:
            problems.append(
                f"{name}: does not fit ({peak:.1f} GiB > {plan.budget / GIB:.1f}, host {plan.host_per_node / GIB:.0f} GiB/node)"
            )
        if name not in readme or abs(readme[name] - peak) > 0.051:
            problems.append(f"{name}: docs/recipes.md says {readme.get(name)} GiB, the dry run {peak:.1f}: update the table (python benchmarks/recipes.py)")  # fmt: skip
    assert not problems, "\n".join(problems)


def test_tiny_layouts_keep_every_kind_within_four_processes() -> None:
    from lightning_plugins import ParallelLayout

    cases = {
        (1, 1, 1, 8, 1): (1, 1, 1, 2, 1),  # FSDP8 -> FSDP2
        (2, 1, 1, 4, 1): (2, 1, 1, 2, 1),  # TP2 x FSDP4 -> TP2 x FSDP2
        (8, 8, 1, 8, 1): (2, 2, 1, 1, 1),  # TP8 x PP8 x FSDP8 -> TP2 x PP2 (data dropped first)
        (2, 1, 4, 2, 1): (2, 1, 2, 1, 1),  # TP2 x CP4 x FSDP2 -> TP2 x CP2
        (1, 1, 1, 4, 2): (1, 1, 1, 2, 2),  # HSDP
        (1, 1, 1, 1, 1): (1, 1, 1, 1, 1),
    }
    keys = ("tp_size", "pp_size", "cp_size", "dp_shard_size", "dp_replicate_size")
    for real, tiny in cases.items():
        got = tiny_layout(ParallelLayout(**dict(zip(keys, real))).resolve(_product(real)))
        assert tuple(getattr(got, k) for k in keys) == tiny, (real, got)
        assert got.world_size <= MAX_TINY_WORLD
    # Expert parallelism adds no rank: EP=8 over FSDP=64 becomes EP=2 over FSDP=2; with no data rank kept, none.
    assert tiny_layout(ParallelLayout(dp_shard_size=64, ep_size=8).resolve(64)) == ParallelLayout(dp_shard_size=2, ep_size=2)
    assert tiny_layout(ParallelLayout(tp_size=8, pp_size=8, dp_shard_size=8, ep_size=8).resolve(512)).ep_size == 1


def _product(sizes: tuple[int, ...]) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total


def _needs_torchvision(path: Path) -> bool:
    """Whether the recipe's twin needs torchvision: an image-text recipe of a Qwen-VL family (its processor)."""
    from lightning_plugins.planner.model_stats import load_model_config
    from lightning_plugins.recipe.tiny_image_text import NEEDS_TORCHVISION

    recipe = load_recipe(path)
    if recipe.data.format != "image_text":
        return False
    return load_model_config(recipe.model.path, multimodal=True).model_type in NEEDS_TORCHVISION


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``name -> tiny twin recipe`` for every shipped recipe whose twin needs no torchvision (written once for both
    doors); the Qwen-VL ones: :func:`vision_twins`."""
    root = tmp_path_factory.mktemp("twins")
    return {name: shrink_recipe(path, root / name, steps=STEPS) for path, name in zip(RECIPES, NAMES)
            if not _needs_torchvision(path)}  # fmt: skip


@pytest.fixture(scope="module")
def vision_twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``name -> tiny twin recipe`` for the shipped recipes whose twins need torchvision (Qwen-VL's processors)."""
    root = tmp_path_factory.mktemp("vision_twins")
    return {name: shrink_recipe(path, root / name, steps=STEPS) for path, name in zip(RECIPES, NAMES)
            if _needs_torchvision(path)}  # fmt: skip


def _fingerprint(twin: Path) -> str:
    """What a twin trains: its recipe without its own paths, and its model's config (identical twins run once)."""
    text = re.sub(r"^(\s*(path|train|eval|output_dir):).*$", r"\1", twin.read_text().split("\n", 1)[1], flags=re.M)
    return hashlib.sha256((text + (twin.parent / "model" / "config.json").read_text()).encode()).hexdigest()


def _door_fingerprint(twin: Path) -> str:
    """What a door sees of a twin: its recipe without the model section or paths (layout, method, levers, data).
    The model family changes nothing in the door, only in the engine below it."""
    text = re.sub(r"^(\s*(path|train|eval|output_dir):).*$", r"\1", twin.read_text().split("\n", 1)[1], flags=re.M)
    return hashlib.sha256(re.sub(r"^model:.*?(?=^\S)", "", text, flags=re.M | re.S).encode()).hexdigest()


def _losses(metrics: Path) -> list[float]:
    with open(metrics, newline="") as handle:
        return [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]


@pytest.mark.slow
@pytest.mark.parametrize("door", ["lightning", "accelerate"])
def test_every_recipe_trains_tiny_through_the_door(twins: dict[str, Path], door: str) -> None:
    """Each recipe's tiny twin (same family, layout kinds, method, levers) trains a few real optimizer steps and its
    loss falls. Twins identical but for their paths (e.g. LoRA FSDP8 of Llama 8B and 70B) run once; through
    accelerate, twins that differ only in their model family run once too (the Lightning door runs every family).
    One launched world per world size runs all of its twins one after another. Slow (about 18 minutes for both doors):
    the doors' own tests train the tiny recipes, and the engine's parity tests every family. The Qwen-VL twins, which
    need torchvision, train in :func:`test_qwen_vl_twins_train_tiny_through_the_door`."""
    _train_through_the_door(twins, door)


@pytest.mark.torchvision
@pytest.mark.parametrize("door", ["lightning", "accelerate"])
def test_qwen_vl_twins_train_tiny_through_the_door(vision_twins: dict[str, Path], door: str) -> None:
    """The Qwen-VL recipes' twins (their processors need torchvision) train through the door, their loss falling."""
    assert len(vision_twins) == 3  # both Qwen2.5-VL recipes and Qwen3-VL-MoE's
    _train_through_the_door(vision_twins, door)


def _train_through_the_door(twins: dict[str, Path], door: str) -> None:
    """Trains each distinct twin of ``twins`` through ``door``, one launched world per world size, and checks that
    every loss falls (DPO's: stays finite) and that every twin is covered by one that ran."""
    key_of = _door_fingerprint if door == "accelerate" else _fingerprint
    unique: dict[str, str] = {}
    for name, twin in twins.items():
        unique.setdefault(key_of(twin), name)
    by_world: dict[int, list[str]] = {}
    for name in unique.values():
        by_world.setdefault(load_recipe(twins[name]).hardware.world_size, []).append(name)
    script = Path(__file__).parents[1] / "scripts" / "smoke_recipes.py"
    for world, names in sorted(by_world.items()):
        paths = [str(twins[name]) for name in names]
        if door == "accelerate":
            config = ROOT / "accelerate_configs" / f"cpu_{world}proc.yaml"
            launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config),
                      "--main_process_port", str(free_port())]  # fmt: skip
            proc = run_command([*launch, str(script), door, *paths], cwd=ROOT, timeout=1200)
        else:
            proc = run_command([sys.executable, str(script), door, *paths], cwd=ROOT, timeout=1200)
        clean_stdout(proc)
    problems = []
    for fingerprint, name in unique.items():
        losses = _losses(twins[name].parent / "run" / door / "metrics.csv")
        if load_recipe(twins[name]).objective.paired:  # DPO on a random tiny model: 6 steps of new pairs move its
            falls = all(math.isfinite(loss) for loss in losses)  # loss around ln 2 (0.66-0.72 seen), not down
        else:
            falls = losses[-1] < 0.95 * losses[0] and min(losses[STEPS // 2 :]) < 0.9 * losses[0]
        if len(losses) != STEPS or not falls:
            problems.append(f"{name}: losses {losses}")
    assert not problems, "\n".join(problems)
    ran = set(unique.values())
    for name, twin in twins.items():  # every recipe is covered by a twin that ran
        assert key_of(twin) in unique and unique[key_of(twin)] in ran, name


def test_tiny_command_writes_a_twin_and_says_how_to_run_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_plugins.cli import main

    recipe = ROOT / "recipes" / "llama-3.1-70b" / "lora_64k_cp.yaml"
    main(["tiny", str(recipe), "--out", str(tmp_path / "twin"), "--steps", "3", "--lora.r=8"])
    out = capsys.readouterr().out
    twin = load_recipe(tmp_path / "twin" / "recipe.yaml")
    assert f"lightning-plugins finetune {tmp_path / 'twin' / 'recipe.yaml'}" in out
    assert "accelerate launch --config_file accelerate_configs/cpu_4proc.yaml -m lightning_plugins.accelerate" in out
    assert (twin.layout.tp_size, twin.layout.cp_size, twin.parallel.cp_backend) == (2, 2, "ulysses")
    assert twin.lora.r == 8 and twin.train.max_steps == 3 and twin.hardware.accelerator == "cpu"
    config = __import__("json").loads((tmp_path / "twin" / "model" / "config.json").read_text())
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("llama", 128, 2)
    assert config["rope_parameters"]["rope_type"] == "llama3"  # Llama 3.1's RoPE scaling, as the real config
    with pytest.raises(SystemExit, match="layout does not fit"):
        main(["tiny", str(recipe), "--out", str(tmp_path / "bad"), "--hardware.nodes=3"])
