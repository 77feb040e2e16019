"""The SLURM batch files in ``recipes/slurm/`` rendered for a node count, no cluster needed: ``srun``, ``scontrol``,
``accelerate`` and ``python`` are stubs that write down what each node would run; the rendered command then
resolves the recipe for that world (``--print-config``) with the real launcher's world variables, or is refused."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from _launch import in_process

ROOT = Path(__file__).parents[2]
SLURM = ROOT / "recipes" / "slurm"
RECIPE = "recipes/llama-3.1-70b/full_tp8_fsdp4.yaml"  # TP=8 x FSDP2=4: 4 nodes of 8 GPUs

STUBS = {
    # Every node of the allocation runs srun's command once, with its SLURM_NODEID (tasks of a node share it).
    "srun": 'while [[ "$1" == --* ]]; do shift; done\nfor ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@"; done',
    "scontrol": 'for ((i = 1; i <= SLURM_NNODES; i++)); do echo "node$i"; done',
    "accelerate": 'echo "node $SLURM_NODEID: accelerate $*" >> "$RENDERED"',
    "python": 'echo "node $SLURM_NODEID: python $*" >> "$RENDERED"',
}


def _render(
    batch: str, nodes: int, tmp_path: Path, *args: str, **env: str
) -> tuple[subprocess.CompletedProcess, list[str]]:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    rendered = tmp_path / f"{batch}-{nodes}.txt"
    slurm = {"SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": f"node[1-{nodes}]", "SLURM_NTASKS_PER_NODE": "8",
             "SLURM_CPUS_ON_NODE": "96"}  # fmt: skip
    environment = {**os.environ, **slurm, **env, "RENDERED": str(rendered), "PATH": f"{stubs}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(SLURM / f"{batch}.sbatch"), *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return proc, rendered.read_text().splitlines() if rendered.exists() else []


def _print_config(command: str, module: str, **world: str) -> subprocess.CompletedProcess:
    """The rendered command, run for real with ``--print-config`` (resolves and checks the recipe, then exits), in this
    process (``python -m MODULE``'s main, no interpreter start)."""
    argv = shlex.split(command.split(": ", 1)[1])
    rest = argv[argv.index(module) + 1 :]
    return in_process(module, [*rest, "--print-config"], **world)


def test_lightning_batch_file_renders_one_trainer_world_over_the_nodes(tmp_path: Path) -> None:
    proc, lines = _render("lightning", 4, tmp_path, RECIPE, "--optim.lr=1e-5")
    assert proc.returncode == 0, proc.stderr
    assert lines == [
        f"node {i}: python -m lightning_plugins finetune {RECIPE} --hardware.nodes=4 --hardware.devices=8"
        " --hardware.accelerator=gpu --optim.lr=1e-5"
        for i in range(4)
    ]
    resolved = _print_config(lines[0], "lightning_plugins")
    assert resolved.returncode == 0, resolved.stderr
    assert "nodes: 4" in resolved.stdout and "devices: 8" in resolved.stdout and "lr: 1.0e-05" in resolved.stdout
    _, wrong = _render("lightning", 3, tmp_path, RECIPE)  # 24 GPUs cannot hold TP=8 x FSDP2=4
    refused = _print_config(wrong[0], "lightning_plugins")
    assert refused.returncode != 0 and "does not fit hardware.devices x hardware.nodes = 24" in refused.stderr


@pytest.mark.parametrize("nodes", [2, 4])
def test_accelerate_batch_file_renders_one_launch_per_node(tmp_path: Path, nodes: int) -> None:
    proc, lines = _render("accelerate", nodes, tmp_path, RECIPE)
    assert proc.returncode == 0, proc.stderr
    assert lines == [
        f"node {i}: accelerate launch --config_file accelerate_configs/{nodes}nodes_8gpu.yaml --num_machines {nodes}"
        f" --num_processes {8 * nodes} --machine_rank {i} --main_process_ip node1 --main_process_port 29500"
        f" --rdzv_backend c10d -m lightning_plugins.accelerate {RECIPE}"
        for i in range(nodes)
    ]
    # What each of the node's processes sees from torchrun: the launched world replaces the recipe's hardware.
    world = {"WORLD_SIZE": str(8 * nodes), "LOCAL_WORLD_SIZE": "8"}
    resolved = _print_config(lines[-1], "lightning_plugins.accelerate", **world)
    if nodes == 4:
        assert resolved.returncode == 0, resolved.stderr
        assert "nodes: 4" in resolved.stdout
    else:
        assert resolved.returncode != 0 and "does not fit hardware.devices x hardware.nodes = 16" in resolved.stderr


def test_accelerate_batch_file_names_the_config_it_lacks(tmp_path: Path) -> None:
    proc, lines = _render("accelerate", 3, tmp_path, RECIPE)
    assert proc.returncode == 2 and not lines
    assert "no launch config accelerate_configs/3nodes_8gpu.yaml" in proc.stderr and "ACCELERATE_CONFIG=" in proc.stderr
    proc, lines = _render("accelerate", 3, tmp_path, RECIPE, ACCELERATE_CONFIG="accelerate_configs/2nodes_8gpu.yaml")
    assert proc.returncode == 0 and len(lines) == 3 and "--num_processes 24 --machine_rank 2" in lines[2]


@pytest.mark.parametrize("batch", ["lightning", "accelerate"])
def test_batch_files_ask_for_the_preemption_signal_and_the_requeue(batch: str) -> None:
    """SLURM sends SIGUSR1 (a preemption signal of the default ``train.preempt_signals``) ahead of the time limit, and
    the job may be requeued (rank 0 runs ``scontrol requeue`` after the checkpoint: tests/checkpoint/test_kill_resume.py)."""
    from lightning_plugins.recipe.train import TrainSection

    lines = (SLURM / f"{batch}.sbatch").read_text().splitlines()
    signal = [line for line in lines if line.startswith("#SBATCH --signal=")]
    assert signal == ["#SBATCH --signal=USR1@120"] and "#SBATCH --requeue" in lines, lines
    assert "SIGUSR1" in TrainSection.model_fields["preempt_signals"].default_factory()
