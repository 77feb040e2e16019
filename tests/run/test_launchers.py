"""``lightning-plugins launch RECIPE --to torchrun|k8s``, checked without a cluster: each node's command is run with
stubs for ``torchrun`` / ``accelerate`` / ``lightning-plugins`` that write down their arguments, which are then parsed
by torchrun's and ``accelerate launch``'s own parsers and resolved for the launched world (``--print-config``); the
Kubernetes manifest is parsed as YAML and its container command run the same way with what the training operator sets.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _launch import in_process

from lightning_plugins.resources import accelerate_configs_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "llama-3.1-70b/full_tp8_fsdp4"  # TP=8 x FSDP2=4: 4 nodes of 8 GPUs
RECORD = 'printf "%s\\n" "$(basename "$0")" "NODE_RANK=${NODE_RANK-}" "RANK=${RANK-}" "$@" > "$RECORDED"'


def _launch(*args: str) -> subprocess.CompletedProcess:
    """``lightning-plugins launch ARGS`` (in this process)."""
    return in_process("lightning_plugins", ["launch", *args])


@functools.cache
def _where(what: str) -> str:
    """What ``lightning-plugins recipes --where WHAT`` prints, from the CLI run in this process."""
    proc = in_process("lightning_plugins", ["recipes", "--where", what])
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    return proc.stdout


def _run_node(command: list[str], tmp_path: Path, **env: str) -> list[str]:
    """Run one node's command with the launchers stubbed; the first stub called records ``[name, NODE_RANK=..,
    RANK=.., *argv]``."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name in ("torchrun", "accelerate"):
        (stubs / name).write_text(f"#!/bin/bash\n{RECORD}\n")
    # `lightning-plugins recipes ...` answers for real; a training command is recorded. The accelerate door's scripts
    # ask `recipes --where accelerate_configs`: the CLI's answer, run in this process (a fresh interpreter importing
    # the package for it took ~6 s a node).
    real, where = shlex.quote(sys.executable), shlex.quote(_where("accelerate_configs"))
    (stubs / "lightning-plugins").write_text(
        f'#!/bin/bash\nif [ "$*" = "recipes --where accelerate_configs" ]; then printf %s {where}; exit; fi\n'
        f'if [ "$1" = recipes ]; then exec {real} -m lightning_plugins "$@"; fi\n{RECORD}\n'
    )
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    recorded = tmp_path / "recorded.txt"
    environment = {**os.environ, **env, "RECORDED": str(recorded), "PATH": f"{stubs}:{os.environ['PATH']}"}
    proc = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return recorded.read_text().splitlines()


def _print_config(module: str, args: list[str], **world: str) -> subprocess.CompletedProcess:
    """A node's recipe arguments, resolved for real (``--print-config``, in this process) with the launched world's
    variables."""
    return in_process(module, [*args, "--print-config"], **world)


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


SLURM_ENV = {"SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_CPUS_ON_NODE": "96"}


def _launch_here(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    """``lightning-plugins launch ARGV`` in this process (no interpreter start): exit status, stdout, stderr."""
    from lightning_plugins.cli import _parser
    from lightning_plugins.recipe.launch import recipe_overrides
    from lightning_plugins.recipe.launchers import main

    parser, commands = _parser()
    args, extra = parser.parse_known_args(["launch", *argv])
    capsys.readouterr()
    code = main(args, recipe_overrides(extra, commands["launch"]))
    out = capsys.readouterr()
    return code, out.out, out.err


def _stub(tmp_path: Path, name: str, body: str) -> Path:
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
    (stubs / name).chmod(0o755)
    return stubs


def test_slurm_script_for_the_lightning_door_runs_one_task_per_gpu(tmp_path: Path, capsys) -> None:
    script = tmp_path / "job.sbatch"
    assert _launch_here(capsys, RECIPE, "--to", "slurm", "--out", str(script), "--time", "1-00:00:00",
                        "--optim.lr=1e-5")[0] == 0  # fmt: skip
    text = script.read_text()
    for option in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--signal=USR1@120", "--requeue",
                   "--time=1-00:00:00", "--job-name=llama-3-1-70b-full-tp8-fsdp4"):  # fmt: skip
        assert f"#SBATCH {option}\n" in text
    # srun's stub runs its command once, as one task would; python is recorded.
    _stub(tmp_path, "srun", 'while [[ "$1" == --* ]]; do shift; done\n"$@"')
    _stub(tmp_path, "python", RECORD)
    recorded = _run_node(["bash", str(script)], tmp_path, **SLURM_ENV)
    assert recorded[0] == "python" and recorded[3:6] == ["-m", "lightning_plugins", "finetune"]
    args = recorded[6:]
    assert args == [RECIPE, "--hardware.nodes=4", "--hardware.devices=8", "--hardware.accelerator=gpu", "--optim.lr=1e-5"]
    resolved = _print_config("lightning_plugins", ["finetune", *args])
    assert resolved.returncode == 0, resolved.stderr
    assert "nodes: 4" in resolved.stdout and "devices: 8" in resolved.stdout


def test_slurm_script_for_the_accelerate_door_runs_one_launcher_per_node(tmp_path: Path, capsys) -> None:
    from accelerate.commands.launch import launch_command_parser

    script = tmp_path / "job.sbatch"
    assert _launch_here(capsys, RECIPE, "--to", "slurm", "--door", "accelerate", "--out", str(script))[0] == 0
    assert "#SBATCH --ntasks-per-node=1\n" in script.read_text()
    _stub(tmp_path, "srun", 'while [[ "$1" == --* ]]; do shift; done\nSLURM_NODEID=2 "$@"')  # the third node
    _stub(tmp_path, "scontrol", 'for ((i = 1; i <= SLURM_NNODES; i++)); do echo "node$i"; done')
    recorded = _run_node(["bash", str(script)], tmp_path, **SLURM_ENV)
    assert recorded[0] == "accelerate" and recorded[3] == "launch"
    args = launch_command_parser().parse_args(recorded[4:])
    assert Path(args.config_file) == accelerate_configs_dir() / "4nodes_8gpu.yaml"
    assert (args.num_machines, args.num_processes, args.machine_rank) == (4, 32, 2)
    assert (args.main_process_ip, args.main_process_port) == ("node1", 29500)
    assert args.training_script_args == [RECIPE]


@pytest.mark.parametrize("door", ["lightning", "accelerate"])
def test_skypilot_task_runs_one_launcher_per_node(tmp_path: Path, capsys, door: str) -> None:
    code, out, err = _launch_here(capsys, RECIPE, "--to", "skypilot", "--door", door, "--bucket", "s3://runs", "--spot",
                                  "--hf-secret", "yes")  # fmt: skip
    assert code == 0, err
    task = yaml.safe_load(out)
    assert (task["name"], task["num_nodes"]) == ("llama-3-1-70b-full-tp8-fsdp4", 4)
    assert task["resources"]["accelerators"] == "H100:8" and task["resources"]["use_spot"] is True
    assert task["file_mounts"] == {"/outputs": {"source": "s3://runs", "mode": "MOUNT_CACHED"}}
    assert task["secrets"] == {"HF_TOKEN": None} and "torch==2.13.0" in task["setup"]
    # What SkyPilot sets on the second node; the bucket's mount point stands in for /outputs.
    run = task["run"].replace("cd /outputs", f"cd {tmp_path}")
    skypilot = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2\n10.0.0.3\n10.0.0.4"}
    recorded = _run_node(["bash", "-c", run], tmp_path, **skypilot)
    if door == "lightning":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(recorded[3:])
        assert (args.nnodes, args.nproc_per_node, args.node_rank, args.rdzv_endpoint) == ("4", "8", 1, "10.0.0.1:29500")
        assert args.training_script_args[:2] == ["finetune", RECIPE]
    else:
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(recorded[4:])
        assert (args.num_machines, args.machine_rank, args.main_process_ip) == (4, 1, "10.0.0.1")
    image = yaml.safe_load(_launch_here(capsys, "llama-3.1-8b/lora_1gpu", "--to", "skypilot", "--image", "reg/lp:1")[1])
    assert image["resources"] == {"accelerators": "H100:1", "image_id": "docker:reg/lp:1"} and "setup" not in image


@pytest.mark.parametrize(("target", "tool", "expected"), [
    ("slurm", "sbatch", ["{out}"]),
    ("k8s", "kubectl", ["apply", "-f", "{out}"]),
    ("skypilot", "sky", ["launch", "--yes", "--cluster", "llama-3-1-8b-lora-1gpu", "{out}"]),
])  # fmt: skip
def test_submit_runs_the_scheduler_or_says_it_is_missing(tmp_path: Path, capsys, monkeypatch, target: str, tool: str,
                                                         expected: list[str]) -> None:  # fmt: skip
    out = tmp_path / "job"
    stubs = _stub(tmp_path, tool, 'printf "%s\\n" "$@" > "$RECORDED"')
    recorded = tmp_path / "recorded.txt"
    argv = ["llama-3.1-8b/lora_1gpu", "--to", target, "--image", "reg/lp:1", "--out", str(out), "--submit"]
    monkeypatch.setenv("RECORDED", str(recorded))
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    code, _, err = _launch_here(capsys, *argv)
    assert code == 0, err
    assert recorded.read_text().splitlines() == [a.format(out=out) for a in expected]
    # Without the tool: the job is written, and the error names the tool and the file.
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    out.unlink()
    code, _, err = _launch_here(capsys, *argv)
    assert code == 127 and f"runs `{tool}`, which is not on PATH" in err
    assert out.is_file() and str(out) in err
    code, _, err = _launch_here(capsys, "llama-3.1-8b/lora_1gpu", "--to", "torchrun", "--submit")
    assert code == 2 and "no scheduler to submit to" in err


# Why a skip: skypilot pins click<8.2 and huggingface_hub needs >=8.4.2, so the schemas cannot be installed beside the
# package; `.ci/wheel` (run by `.ci/run`) makes their own virtualenv and runs this same validation there, every CI run.
@pytest.mark.skipif("LP_SCHEMA_PYTHON" not in os.environ, reason="set LP_SCHEMA_PYTHON to a python with skypilot,"
                    " kubeflow-training, jsonschema and pyyaml (.ci/wheel makes one and validates there)")  # fmt: skip
def test_jobs_are_valid_against_skypilots_and_the_operators_schemas(tmp_path: Path, capsys) -> None:
    jobs = []
    for door in ("lightning", "accelerate"):
        for target, extra in (("k8s", ["--image", "reg/lp:1", "--pvc", "runs", "--hf-secret", "hf"]),
                              ("skypilot", ["--bucket", "s3://runs", "--spot", "--hf-secret", "yes"])):  # fmt: skip
            jobs.append(tmp_path / f"{door}-{target}.yaml")
            assert _launch_here(capsys, RECIPE, "--to", target, "--door", door, *extra, "--out", str(jobs[-1]))[0] == 0
    checked = subprocess.run([os.environ["LP_SCHEMA_PYTHON"], str(ROOT / ".ci" / "launcher_schemas.py"), *map(str, jobs)],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    bad = yaml.safe_load(jobs[0].read_text())
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicaz"] = 1
    jobs[0].write_text(yaml.safe_dump(bad))
    refused = subprocess.run([os.environ["LP_SCHEMA_PYTHON"], str(ROOT / ".ci" / "launcher_schemas.py"), str(jobs[0])],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode != 0
