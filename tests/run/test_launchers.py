"""``lightning-plugins launch RECIPE --to torchrun|k8s``, checked without a cluster: each node's command is run with
stubs for ``torchrun`` / ``accelerate`` / ``lightning-plugins`` that write down their arguments, which are then parsed
by torchrun's and ``accelerate launch``'s own parsers and resolved for the launched world (``--print-config``); the
Kubernetes manifest is parsed as YAML and its container command run the same way with what the training operator sets.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_plugins.resources import accelerate_configs_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "llama-3.1-70b/full_tp8_fsdp4"  # TP=8 x FSDP2=4: 4 nodes of 8 GPUs
RECORD = 'printf "%s\\n" "$(basename "$0")" "NODE_RANK=${NODE_RANK-}" "RANK=${RANK-}" "$@" > "$RECORDED"'


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_plugins", "launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def _run_node(command: list[str], tmp_path: Path, **env: str) -> list[str]:
    """Run one node's command with the launchers stubbed; the first stub called records ``[name, NODE_RANK=..,
    RANK=.., *argv]``."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name in ("torchrun", "accelerate"):
        (stubs / name).write_text(f"#!/bin/bash\n{RECORD}\n")
    # `lightning-plugins recipes --where ...` answers for real; a training command is recorded.
    real = shlex.quote(sys.executable)
    (stubs / "lightning-plugins").write_text(f'#!/bin/bash\nif [ "$1" = recipes ]; then exec {real} -m lightning_plugins'
                                             f' "$@"; fi\n{RECORD}\n')  # fmt: skip
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    recorded = tmp_path / "recorded.txt"
    environment = {**os.environ, **env, "RECORDED": str(recorded), "PATH": f"{stubs}:{os.environ['PATH']}"}
    proc = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return recorded.read_text().splitlines()


def _print_config(module: str, args: list[str], **world: str) -> subprocess.CompletedProcess:
    """A node's recipe arguments, resolved for real (``--print-config``) with the launched world's variables."""
    env = {**os.environ, **world}
    return subprocess.run([sys.executable, "-m", module, *args, "--print-config"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_torchrun_script_starts_the_lightning_door_on_every_node(tmp_path: Path) -> None:
    from torch.distributed.run import get_args_parser

    script = tmp_path / "job.sh"
    assert _launch(RECIPE, "--to", "torchrun", "--out", str(script), "--optim.lr=1e-5").returncode == 0
    recorded = _run_node(["bash", str(script)], tmp_path, NODE_RANK="2", MASTER_ADDR="node0", MASTER_PORT="29400")
    assert recorded[:3] == ["torchrun", "NODE_RANK=2", "RANK="]
    args = get_args_parser().parse_args(recorded[3:])  # torchrun's own parser
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("4", "8", 2)
    assert (args.rdzv_backend, args.rdzv_endpoint, args.module) == ("c10d", "node0:29400", True)
    assert args.training_script == "lightning_plugins"
    assert args.training_script_args == ["finetune", RECIPE, "--hardware.nodes=4", "--hardware.devices=8",
                                         "--hardware.accelerator=gpu", "--optim.lr=1e-5"]  # fmt: skip
    resolved = _print_config("lightning_plugins", args.training_script_args)
    assert resolved.returncode == 0, resolved.stderr
    assert "nodes: 4" in resolved.stdout and "devices: 8" in resolved.stdout and "lr: 1.0e-05" in resolved.stdout
    # Without the node's variables the script stops before starting anything.
    unset = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert unset.returncode != 0 and "set NODE_RANK" in unset.stderr


def test_torchrun_script_runs_one_accelerate_launch_per_node(tmp_path: Path) -> None:
    from accelerate.commands.launch import launch_command_parser

    script = tmp_path / "job.sh"
    assert _launch(RECIPE, "--to", "torchrun", "--door", "accelerate", "--out", str(script)).returncode == 0
    recorded = _run_node(["bash", str(script)], tmp_path, NODE_RANK="3", MASTER_ADDR="node0")
    assert recorded[0] == "accelerate" and recorded[3] == "launch"
    args = launch_command_parser().parse_args(recorded[4:])  # accelerate launch's own parser
    assert Path(args.config_file) == accelerate_configs_dir() / "4nodes_8gpu.yaml"
    assert (args.num_machines, args.num_processes, args.machine_rank) == (4, 32, 3)
    assert (args.main_process_ip, args.main_process_port, args.rdzv_backend) == ("node0", 29500, "c10d")
    assert args.module and args.training_script == "lightning_plugins.accelerate"
    assert args.training_script_args == [RECIPE]
    # What each of the node's processes sees from torchrun: the launched world replaces the recipe's hardware.
    resolved = _print_config("lightning_plugins.accelerate", args.training_script_args, WORLD_SIZE="32",
                             LOCAL_WORLD_SIZE="8")  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr
    assert "nodes: 4" in resolved.stdout


@pytest.mark.parametrize("door", ["lightning", "accelerate"])
def test_k8s_manifest_is_a_pytorchjob_whose_pods_are_the_nodes(tmp_path: Path, door: str) -> None:
    proc = _launch(RECIPE, "--to", "k8s", "--door", door, "--image", "registry/lp:1", "--pvc", "runs", "--hf-secret", "hf")
    assert proc.returncode == 0, proc.stderr
    job = yaml.safe_load(proc.stdout)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "llama-3-1-70b-full-tp8-fsdp4")  # fmt: skip
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {name: spec["replicas"] for name, spec in replicas.items()} == {"Master": 1, "Worker": 3}
    for spec in replicas.values():
        assert spec["restartPolicy"] == "OnFailure"  # a preempted run (exit 75) restarts and resumes
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["image"] == "registry/lp:1"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
        assert container["workingDir"] == "/workspace"  # train.output_dir on the shared claim
        assert {"name": "work", "persistentVolumeClaim": {"claimName": "runs"}} in pod["volumes"]
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in container["env"]
        assert pod["terminationGracePeriodSeconds"] >= 300
    command = replicas["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["bash", "-c"]
    # What the training operator sets in the second pod (the first worker).
    operator = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    recorded = _run_node(command, tmp_path, **operator)
    if door == "lightning":  # Lightning's own launcher: NODE_RANK from the pod's RANK, which is then unset
        assert recorded[:3] == ["lightning-plugins", "NODE_RANK=1", "RANK="]
        from lightning_plugins.cli import _parser

        args, extra = _parser()[0].parse_known_args(recorded[3:])
        assert args.command == "finetune" and args.recipe == RECIPE
        resolved = _print_config("lightning_plugins", recorded[3:])
        assert resolved.returncode == 0, resolved.stderr
        assert "nodes: 4" in resolved.stdout and "devices: 8" in resolved.stdout
    else:
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(recorded[4:])
        assert (args.num_machines, args.num_processes, args.machine_rank) == (4, 32, 1)
        assert (args.main_process_ip, args.main_process_port) == ("job-master-0", 23456)


def test_a_world_the_layout_does_not_fill_is_refused_and_one_node_has_no_workers() -> None:
    refused = _launch(RECIPE, "--to", "k8s", "--nodes", "3")
    assert refused.returncode == 2 and "does not fit hardware.devices x hardware.nodes = 24" in refused.stderr
    assert refused.stdout == ""
    single = yaml.safe_load(_launch("llama-3.1-8b/lora_1gpu", "--to", "k8s").stdout)
    replicas = single["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Master"]
    assert replicas["Master"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    unknown = _launch("llama-3.1-70b/full_tp8", "--to", "torchrun")
    assert unknown.returncode == 2 and "llama-3.1-70b/full_tp8_fsdp4" in unknown.stderr
    assert json.dumps(replicas)  # plain data: no YAML anchors or Python objects
