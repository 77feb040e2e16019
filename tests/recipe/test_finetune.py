"""`lightning-plugins finetune` on the tiny recipes, end to end on 2 CPU processes: the loss falls, the
checkpoints resume, and the exported model or adapter loads in plain transformers / peft."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning_plugins.testing.world import run_command
from safetensors import safe_open
from transformers import AutoModelForCausalLM

TINY = Path(__file__).parents[2] / "recipes" / "tiny"
CHAIN = Path(__file__).parents[1] / "scripts" / "finetune_chain.py"
SHORT = ["--train.log_every=5", "--train.eval_every=10", "--train.checkpoint_every=10", "--optim.warmup_steps=5"]


def _argv(recipe: str, out: Path, steps: int, *extra: str) -> list[str]:
    return [str(TINY / recipe), f"--train.max_steps={steps}", f"--train.output_dir={out}", *SHORT, *extra]


def _clean(proc: subprocess.CompletedProcess) -> str:
    assert "warning" not in proc.stderr.lower(), proc.stderr[-3000:]  # a clean console
    return proc.stdout


def _finetune(recipe: str, out: Path, steps: int, *extra: str) -> str:
    command = [sys.executable, "-m", "lightning_plugins", "finetune", *_argv(recipe, out, steps, *extra)]
    return _clean(run_command(command, cwd=out.parent))


def _finetune_chain(runs: list[tuple], cwd: Path) -> str:
    """:func:`_finetune` of each ``(recipe, out, steps, *extra)``, one after another in one launched world."""
    argv = [_argv(*run) for run in runs]
    return _clean(run_command([sys.executable, str(CHAIN), json.dumps(argv)], cwd=cwd))


def _losses(out: Path, key: str = "train/loss") -> list[tuple[int, float]]:
    with open(out / "metrics.csv", newline="") as handle:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(handle) if row.get(key)]


def _falls(out: Path, factor: float) -> None:
    losses = _losses(out)
    assert len(losses) >= 3 and losses[-1][1] < factor * losses[0][1], losses
    assert _losses(out, "val/loss"), "no evaluation ran"
    assert (out / "loss_curve.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def trained_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full fine-tune of the tiny model (TP=2), resumed once: its HF export is the base the LoRA runs adapt.

    (LoRA on the shipped, randomly initialised tiny model barely moves the loss: its frozen embeddings and
    head carry no information yet. LoRA adapts a trained model, as it does in practice.)
    """
    out = tmp_path_factory.mktemp("full") / "run"
    _finetune("full_tp2.yaml", out, 20)
    _falls(out, 0.8)
    stdout = _finetune("full_tp2.yaml", out, 30)  # the same command with more steps picks up the last checkpoint
    assert f"resumed_from: {out / 'checkpoints' / 'step=20.ckpt'}" in stdout, stdout
    assert [step for step, _ in _losses(out)][-1] == 29
    return out / "hf"


def _same_logits(got: torch.nn.Module, want: torch.nn.Module) -> None:
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, want(ids).logits, rtol=0, atol=0)


def _export(checkpoint: Path, out: Path, *args: str) -> Path:
    """``lightning-plugins export`` of a door's checkpoint, in one process (no process group)."""
    from lightning_plugins.cli import main

    main(["export", str(checkpoint), str(out), *args])
    return out


@pytest.mark.slow
def test_full_tp2_exports_and_resumes(trained_base: Path, tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(trained_base)
    assert model(torch.tensor([[1, 5, 6]])).logits.isfinite().all()
    # The last checkpoint (TP=2 DTensor shards) exported streaming equals the in-memory export of the same weights.
    exported = _export(trained_base.parent / "checkpoints" / "step=30.ckpt", tmp_path / "export")
    _same_logits(AutoModelForCausalLM.from_pretrained(exported), model)


def test_full_pp2_exports_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _finetune("full_pp2.yaml", out, 20)
    _falls(out, 0.8)
    with safe_open(str(out / "hf" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    reference = set(AutoModelForCausalLM.from_pretrained(TINY / "model").state_dict())
    assert names == reference, sorted(reference ^ names)
    exported = _export(out / "checkpoints" / "step=20.ckpt", tmp_path / "export")  # each stage's file
    _same_logits(AutoModelForCausalLM.from_pretrained(exported), AutoModelForCausalLM.from_pretrained(out / "hf"))


@pytest.fixture(scope="module")
def adapted(trained_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``recipe -> output directory`` of the adapter recipes (LoRA TP=2 merged, QLoRA, packed chat) trained on the
    trained base, one after another in one launched world."""
    root = tmp_path_factory.mktemp("adapted")
    extra = {"lora_tp2.yaml": ["--train.merge_lora=true"], "qlora_fsdp2.yaml": [], "lora_fsdp2_chat.yaml": []}
    base = f"--model.path={trained_base}"
    _finetune_chain([(recipe, root / recipe, 20, base, *more) for recipe, more in extra.items()], root)
    return {recipe: root / recipe for recipe in extra}


@pytest.mark.slow
def test_lora_tp2_writes_an_adapter(trained_base: Path, adapted: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel

    out = adapted["lora_tp2.yaml"]
    _falls(out, 0.97)
    assert {p.name for p in (out / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained_base), out / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(tuned(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(trained_base)(ids).logits, merged(ids).logits)
    ckpt = out / "checkpoints" / "step=20.ckpt"  # the adapter (TP=2) and the merge, streaming from the checkpoint
    adapter = _export(ckpt, tmp_path / "a")
    _same_logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained_base), adapter), tuned)
    streamed = AutoModelForCausalLM.from_pretrained(_export(ckpt, tmp_path / "m", "--merge"))
    for name, weight in tuned.merge_and_unload().state_dict().items():
        torch.testing.assert_close(streamed.state_dict()[name], weight, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.slow
def test_qlora_and_packed_chat(adapted: dict[str, Path]) -> None:
    for recipe in ("qlora_fsdp2.yaml", "lora_fsdp2_chat.yaml"):
        _falls(adapted[recipe], 0.97)
