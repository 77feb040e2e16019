"""The real ``accelerate launch`` with the shipped CPU config runs the tiny recipes through the Accelerate door,
and every step equals the Lightning door's on the same recipe and seed (loss, learning rate, gradient norm,
held-out loss): same data order, same schedule, same engine. The tiny DPO recipe logs TRL's metrics alike in both
doors. A run stopped after a checkpoint resumes on the same trajectory, under another layout (PP=2 -> TP=2), and a DPO
run under the same one."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from _launch import TINY, accelerate_launch, clean_stdout, collected, shared_finetune_runs

STEPS = 6
SHORT = [f"--train.max_steps={STEPS}", "--train.log_every=1", "--train.eval_every=3", "--train.checkpoint_every=2",
         "--optim.warmup_steps=2"]  # fmt: skip
#: The tiny recipes each door runs, compared step by step.
COMPARED = ["full_tp2.yaml", "full_pp2.yaml", "full_cp2.yaml"]
COLUMNS = ("train/loss", "train/lr", "train/grad_norm", "val/loss")
#: DPO with LoRA under FSDP2=2: both doors log TRL's metrics of every step and held-out evaluation.
DPO = "dpo_lora_fsdp2.yaml"
DPO_COLUMNS = tuple(f"{split}/{name}" for split in ("train", "val") for name in (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
    "logits/chosen", "logits/rejected"))  # fmt: skip
#: A tiny Mixtral under expert parallelism (written by the `recipes` fixture): both doors log its routing balance.
MOE = "moe_ep2.yaml"
MOE_COLUMNS = ("moe/load_max_over_mean", "moe/router_entropy")


def _moe_recipe(root: Path) -> Path:
    """full_tp2.yaml with a tiny Mixtral (the tiny tokenizer, 4 experts, top-2) split over EP=2 instead of TP=2."""
    import yaml
    from transformers import MixtralConfig, MixtralForCausalLM

    base = json.loads((TINY / "model" / "config.json").read_text())
    shared = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
              "tie_word_embeddings")  # fmt: skip
    torch.manual_seed(0)
    experts = {"num_local_experts": 4, "num_experts_per_tok": 2}
    config = MixtralConfig(**{k: base[k] for k in shared}, intermediate_size=64, **experts)
    # The fused experts as the model holds them (the sharded loader reads names as stored; the per-expert original
    # format that save_pretrained writes by default is the checkpoint part's matter).
    MixtralForCausalLM(config).save_pretrained(root / "model", save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TINY / "model" / name, root / "model" / name)
    recipe = yaml.safe_load((TINY / "full_tp2.yaml").read_text())
    recipe["model"]["path"] = str(root / "model")
    recipe["data"].update(train=str(TINY / recipe["data"]["train"]), eval=str(TINY / recipe["data"]["eval"]))
    recipe["layout"], recipe["parallel"] = {"ep_size": 2}, {}
    recipe["train"]["micro_batch_size"] = 8  # EP ranks are data ranks: 2 x 8 rows a step
    (root / MOE).write_text(yaml.safe_dump(recipe))
    return root / MOE


@pytest.fixture(scope="module")
def recipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``recipe name -> path`` of every recipe both doors run."""
    return {**{recipe: TINY / recipe for recipe in [*COMPARED, DPO]}, MOE: _moe_recipe(tmp_path_factory.mktemp("moe"))}


@pytest.fixture(scope="module")
def lightning(
    recipes: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Path]:
    """``recipe -> output directory`` of the Lightning door's run of each compared recipe this session runs, one after
    another in one launched world (``_launch.shared_finetune_runs``: with the other 2-rank Lightning runs the session's
    tests declared); the default suite leaves out the recipes whose tests are slow (3 of the 5 runs)."""
    wanted = {params["recipe"] for params in collected(request, "test_accelerate_launch_matches_the_lightning_door")}
    recipes = {recipe: path for recipe, path in recipes.items() if recipe in wanted}
    runs = [[str(path), *SHORT] for path in recipes.values()]
    return dict(zip(recipes, shared_finetune_runs(tmp_path_factory, runs, 600, clean=True), strict=True))


def _metrics(out: Path) -> dict[str, list[tuple[int, float]]]:
    with open(out / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    keys = COLUMNS + MOE_COLUMNS + DPO_COLUMNS
    return {key: [(int(r["step"]), float(r[key])) for r in rows if r.get(key)] for key in keys}


def _same(accelerate: Path, lightning: Path, columns: tuple[str, ...] = COLUMNS) -> None:
    got, want = _metrics(accelerate), _metrics(lightning)
    for key in columns:
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]] and want[key], (key, got[key], want[key])
        values = torch.tensor([v for _, v in got[key]]), torch.tensor([v for _, v in want[key]])
        torch.testing.assert_close(*values, rtol=1e-5, atol=1e-5, msg=key)
    assert len(got["train/loss"]) == STEPS and len(got["val/loss"]) == 2


def _exports_like(checkpoint: Path, reference: Path, out: Path) -> None:
    """``lightning-plugins export`` of the checkpoint (one process, streaming) loads like the door's own export."""
    from transformers import AutoModelForCausalLM

    from lightning_plugins.cli import main

    main(["export", str(checkpoint), str(out)])
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        got, want = (AutoModelForCausalLM.from_pretrained(d)(ids).logits for d in (out, reference))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "recipe",
    [pytest.param(COMPARED[0], marks=pytest.mark.slow), COMPARED[1], pytest.param(COMPARED[2], marks=pytest.mark.slow),
     MOE, pytest.param(DPO, marks=pytest.mark.slow)],
)  # fmt: skip
def test_accelerate_launch_matches_the_lightning_door(
    recipes: dict[str, Path], lightning: dict[str, Path], tmp_path: Path, recipe: str
) -> None:
    out = tmp_path / "accelerate"
    stdout = clean_stdout(accelerate_launch(recipes[recipe], out, *SHORT))
    exported = out / ("adapter" if recipe == DPO else "hf")
    assert f"model: {exported}" in stdout and (out / "loss_curve.png").stat().st_size > 1000
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    if recipe != DPO:  # a LoRA run exports its adapter (tests/adapters check those exports)
        _exports_like(out / "checkpoints" / "step=6.ckpt", exported, tmp_path / "export")
    _same(out, lightning[recipe], COLUMNS + DPO_COLUMNS if recipe == DPO else COLUMNS)
    if recipe == DPO:  # interrupted after step 4: the same command resumes on the uninterrupted trajectory
        shutil.rmtree(out / "checkpoints" / "step=6.ckpt")
        stdout = clean_stdout(accelerate_launch(recipes[recipe], out, *SHORT))
        assert f"resumed_from: {out / 'checkpoints' / 'step=4.ckpt'}" in stdout, stdout
        assert (out / "logs" / "version_1" / "metrics.csv").is_file()
        _same(out, lightning[recipe], COLUMNS + DPO_COLUMNS)
    if recipe == MOE:  # every step's routing balance, over both ranks, in both doors' metrics.csv
        got, want = _metrics(out), _metrics(lightning[recipe])
        for key in MOE_COLUMNS:
            steps = [s for s, _ in got[key]], [s for s, _ in want[key]]
            assert steps == (list(range(STEPS)),) * 2, (key, got[key], want[key])
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=1e-5, atol=1e-5, msg=key)
        assert all(1.0 <= v <= 4 for _, v in got[MOE_COLUMNS[0]]) and all(0 < v <= 0.7 for _, v in got[MOE_COLUMNS[1]])
    if recipe == "full_pp2.yaml":  # interrupted after step 4: the same command resumes from its checkpoint, resharded
        # from PP=2 (each rank its stage) to TP=2 (DTensor shards of every weight and its optimizer state).
        shutil.rmtree(out / "checkpoints" / "step=6.ckpt")
        tp2 = ["--layout.pp_size=1", "--layout.tp_size=2"]
        stdout = clean_stdout(accelerate_launch(TINY / recipe, out, *SHORT, *tp2))
        assert f"resumed_from: {out / 'checkpoints' / 'step=4.ckpt'}" in stdout, stdout
        assert (out / "logs" / "version_1" / "metrics.csv").is_file()
        # The training trajectory is the PP=2 run's. The held-out loss is not compared: on the same weights the
        # Lightning door alone evaluates it ~1e-3 apart under TP=2 and PP=2 (a layout matter, not a checkpoint one).
        _same(out, lightning[recipe], COLUMNS[:3])
