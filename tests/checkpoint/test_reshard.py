"""A checkpoint saved under one layout resumes under another on the same per-step trajectory (Lightning door, fp32):
TP=2 x PP=2 (4 ranks) -> FSDP2=4 -> TP=2 (2 ranks: another world size), FSDP2=4 -> CP=2 -> TP=2, and TP=2 x PP=2 ->
PP=2 interleaved (2 virtual stages per rank: each rank now holds layers 0 and 2, or 1 and 3, where the saving
pipeline split them 0-1 / 2-3); and every checkpoint names its parameters with the HF model's own names, whatever
the layout. The model is the shipped tiny Llama's config with 4 layers (random weights), so 4 stages exist.

One chain of runs: each resumes a checkpoint an earlier layout wrote and must continue the uninterrupted TP x PP
run's losses (layouts agree to 1e-5: the parity tests). The data position is kept in samples, so a different
micro-batch size x data-parallel size finds the same place. Consecutive runs of the same world size share one
launched world (``tests/scripts/finetune_chain.py``): two launches instead of six.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from itertools import groupby
from pathlib import Path

import pytest
import torch
from lightning_plugins.testing.world import run_command
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).parents[2]
TINY = ROOT / "recipes" / "tiny"
STEPS = 8
COMMON = [f"--train.max_steps={STEPS}", "--train.log_every=1", "--train.eval_every=100", "--train.checkpoint_every=2",
          "--optim.warmup_steps=2", "--parallel.pp_microbatches=2"]  # fmt: skip
# Global batch 16 = 2 micro-batches of 8 samples over all data-parallel ranks in every layout.
LAYOUTS = {
    "tp2xpp2": ["--layout.tp_size=2", "--layout.pp_size=2", "--hardware.devices=4", "--train.micro_batch_size=8"],
    "fsdp4": ["--layout.pp_size=1", "--layout.dp_shard_size=4", "--hardware.devices=4", "--train.micro_batch_size=2"],
    "tp2": ["--layout.pp_size=1", "--layout.tp_size=2", "--hardware.devices=2", "--train.micro_batch_size=8"],
    "cp2": ["--layout.pp_size=1", "--layout.cp_size=2", "--hardware.devices=2", "--train.micro_batch_size=8"],
    "pp2_interleaved": [
        "--layout.pp_size=2",
        "--parallel.pp_schedule=interleaved_1f1b",
        "--hardware.devices=2",
        "--train.micro_batch_size=8",
    ],
}
# (layout, resumes (layout it was saved under, step))
CHAIN = [
    ("tp2xpp2", None),
    ("fsdp4", ("tp2xpp2", 2)),
    ("tp2", ("fsdp4", 4)),
    ("cp2", ("fsdp4", 4)),
    ("tp2", ("cp2", 6)),
    ("pp2_interleaved", ("tp2xpp2", 6)),
]
LAYERS = 4


def _four_layer_model(directory: Path) -> Path:
    """The tiny model's config, tokenizer and files with ``LAYERS`` decoder layers (fixed random weights)."""
    shutil.copytree(TINY / "model", directory)
    (directory / "model.safetensors").unlink()
    config = AutoConfig.from_pretrained(directory)
    config.num_hidden_layers = LAYERS
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _world_size(layout: str) -> int:
    return int(next(arg for arg in LAYOUTS[layout] if arg.startswith("--hardware.devices=")).split("=")[1])


def _finetune_chain(runs: list[list[str]]) -> str:
    """Run each argument list of ``lightning-plugins finetune`` in turn in one launched world; return its stdout."""
    command = [sys.executable, str(Path(__file__).parents[1] / "scripts" / "finetune_chain.py"), json.dumps(runs)]
    return run_command(command, cwd=ROOT, timeout=600).stdout


def _losses(out: Path) -> dict[int, float]:
    with open(out / "metrics.csv", newline="") as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")}


def _hf_names(checkpoint: Path) -> set[str]:
    """The model's parameter names in a Lightning-door DCP checkpoint, without the LightningModule's prefix."""
    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    prefix = "state_dict.model."  # the checkpoint's `state_dict` entry; RecipeModule.model is the HF model
    return {key[len(prefix) :] for key in keys if key.startswith(prefix)}


@pytest.mark.slow  # the default suite reshards in test_moe_checkpoint (load, resume, reshard, export)
def test_checkpoints_reshard_across_layouts(tmp_path: Path) -> None:
    model = _four_layer_model(tmp_path / "model")
    reference = set(AutoModelForCausalLM.from_pretrained(model).state_dict())
    outs = [tmp_path / f"{index}_{layout}" for index, (layout, _) in enumerate(CHAIN)]
    latest: dict[str, Path] = {}  # layout -> the output directory of its latest run so far
    resumed: dict[int, Path] = {}  # run -> the checkpoint it resumes
    for index, (layout, source) in enumerate(CHAIN):
        if source is not None:
            resumed[index] = latest[source[0]] / "checkpoints" / f"step={source[1]}.ckpt"
        latest[layout] = outs[index]
    argv = [[str(TINY / "full_pp2.yaml"), f"--model.path={model}", f"--train.output_dir={out}", *COMMON,
             *LAYOUTS[layout], *([f"--resume={resumed[index]}"] if index in resumed else [])]
            for index, (out, (layout, _)) in enumerate(zip(outs, CHAIN))]  # fmt: skip
    stdout: dict[int, str] = {}
    for _, group in groupby(range(len(CHAIN)), key=lambda index: _world_size(CHAIN[index][0])):
        runs = list(group)  # consecutive runs of one world size, in one world: each resumes an earlier run's checkpoint
        stdout.update(dict.fromkeys(runs, _finetune_chain([argv[index] for index in runs])))
    want: dict[int, float] = {}
    for index, ((layout, source), out) in enumerate(zip(CHAIN, outs)):
        got = _losses(out)
        if source is None:
            want = got
            assert sorted(want) == list(range(STEPS)), want
        else:
            assert f"resumed_from: {resumed[index]}\n" in stdout[index], stdout[index][-2000:]
            steps = list(range(source[1], STEPS))
            assert sorted(got) == steps, (layout, source, got)
            torch.testing.assert_close(
                torch.tensor([got[s] for s in steps]), torch.tensor([want[s] for s in steps]), rtol=1e-5, atol=1e-5,
                msg=f"{source[0]} -> {layout}: {got} vs {want}",
            )  # fmt: skip
        names = _hf_names(out / "checkpoints" / f"step={STEPS}.ckpt")
        assert names == reference, (layout, sorted(names ^ reference))
