"""``lightning-plugins launch RECIPE --to slurm|torchrun|k8s|skypilot [--submit]``: the job that runs a recipe on its
hardware, written (and with ``--submit`` submitted: ``sbatch``, ``kubectl apply``, ``sky launch``).

A job is one launcher per node with a rendezvous, which is what this writes, for either door:

* ``--to slurm``: an ``sbatch`` script for the recipe's nodes and GPUs, as ``recipes/slurm/*.sbatch`` (which take any
  recipe and node count): the Lightning door's ranks are ``srun``'s tasks (one per GPU, read by Lightning's
  ``SLURMEnvironment``), the Accelerate door's one ``accelerate launch`` per node. ``SIGUSR1`` 120 s before the time
  limit makes every rank write its checkpoint; the job is requeued and resumes from it.
* ``--to skypilot``: a SkyPilot task (``num_nodes``, ``accelerators: <gpu>:<n>``); each node runs torchrun (or
  ``accelerate launch``) with node 0 of ``SKYPILOT_NODE_IPS`` as the rendezvous. With ``--bucket`` the working
  directory (``train.output_dir`` and its checkpoints) is a bucket mounted on every node, so a managed job
  (``sky jobs launch``, ``--spot``) that SkyPilot recovers after a preemption resumes from the last checkpoint.

* ``--to torchrun``: a bash script that each node runs with ``NODE_RANK`` and ``MASTER_ADDR`` set (bare machines, or
  any scheduler that starts one process per node). The Lightning door's ranks are started by ``torchrun`` (c10d
  rendezvous on node 0), the Accelerate door's by one ``accelerate launch`` per node, as
  ``recipes/slurm/accelerate.sbatch`` does.
* ``--to k8s``: a Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``: one ``Master`` pod and ``nodes - 1`` ``Worker`` pods,
  one per node, each with the node's GPUs). The training operator gives every pod ``MASTER_ADDR``, ``MASTER_PORT`` and
  its ``RANK`` (the pod's index), which become the node rank and the rendezvous. The Lightning door's ranks are started
  by Lightning's own launcher there (``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``, as ``tests/run/test_two_nodes.py``
  runs two nodes on one machine), the Accelerate door's by ``accelerate launch``.

Either way the recipe's layout must fill ``nodes x gpus per node``: checked here before anything is written, and again
by every rank.

Preemption: SIGTERM to the Lightning door's own launcher (Kubernetes evicting a pod sends it to the container) makes
every rank finish its step, write ``checkpoints/step=N.ckpt`` and exit 75; the pod restarts (``restartPolicy:
OnFailure``) and the same command resumes from that checkpoint, when ``train.output_dir`` is on a volume every pod
shares (``--pvc``). torchrun (and ``accelerate launch``, which runs it) SIGKILLs its workers 30 s after it forwards a
SIGTERM, so a checkpoint that takes longer is lost there.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TARGETS = ("slurm", "torchrun", "k8s", "skypilot")
DOORS = ("lightning", "accelerate")
PORT = 29500
#: Kubernetes waits this long after SIGTERM before it kills a pod: time for every rank's preemption checkpoint.
GRACE_S = 600


#: What a SIGTERM to a node's launcher does, by door.
PREEMPTION = {
    "lightning": "SIGTERM to this script's process (torchrun) stops every rank with a checkpoint, but\n# torchrun"
    " SIGKILLs the workers 30 s after it forwards the SIGTERM; the same command on every node resumes from the last"
    " checkpoint.",
    "accelerate": "SIGTERM to this script's process stops every rank with a checkpoint, but torchrun\n# SIGKILLs the"
    " workers 30 s after it forwards the SIGTERM; the same command on every node resumes from the last checkpoint.",
}


@dataclass(frozen=True)
class Job:
    """What one launch runs: the recipe (a shipped id or a path, as given), the world and the door.

    Attributes:
        recipe: The recipe as the command line names it (a shipped id works wherever the package is installed).
        nodes: Nodes (one launcher each).
        gpus_per_node: Ranks per node.
        door: ``lightning`` (``lightning-plugins finetune``) or ``accelerate`` (``accelerate launch``).
        overrides: ``section.key=value`` recipe overrides, passed on.
        name: The job's name (the Kubernetes object's, and the rendezvous id).
    """

    recipe: str
    nodes: int
    gpus_per_node: int
    door: str = "lightning"
    overrides: tuple[str, ...] = ()
    name: str = "lightning-plugins"


def accelerate_config(nodes: int) -> str:
    """The shipped launch config for ``nodes`` nodes of 8 GPUs (its counts are replaced by the command's flags)."""
    from lightning_plugins.resources import accelerate_configs_dir

    name = "1node_8gpu.yaml" if nodes == 1 else f"{nodes}nodes_8gpu.yaml"
    return name if (accelerate_configs_dir() / name).is_file() else "2nodes_8gpu.yaml"


def node_command(job: Job, node_rank: str, master_addr: str, master_port: str, torchrun: bool = True) -> str:
    """The shell command one node runs, with the node rank and rendezvous given as shell words (``"$NODE_RANK"``).

    Args:
        torchrun: The Lightning door's ranks started by torchrun (c10d rendezvous); else by Lightning's own launcher
            (``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``), which has no 30 s limit on a preemption checkpoint.
    """
    overrides = [f"--{o}" for o in job.overrides]
    if job.door == "lightning":
        finetune = shlex.join(["finetune", job.recipe, f"--hardware.nodes={job.nodes}",
                               f"--hardware.devices={job.gpus_per_node}", "--hardware.accelerator=gpu", *overrides])  # fmt: skip
        if torchrun:  # NODE_RANK tells each node's first rank that it is not the job's first
            world = shlex.join([f"--nnodes={job.nodes}", f"--nproc-per-node={job.gpus_per_node}"])
            return (f"export NODE_RANK={node_rank}; exec torchrun {world} --node-rank={node_rank} --rdzv-backend=c10d"
                    f" --rdzv-endpoint={master_addr}:{master_port} --rdzv-id={job.name} -m lightning_plugins {finetune}")  # fmt: skip
        # A scheduler's RANK and WORLD_SIZE (the pod's, not a process's) would mislead the ranks Lightning starts.
        return (f"export NODE_RANK={node_rank} MASTER_ADDR={master_addr} MASTER_PORT={master_port}; "
                f"unset RANK WORLD_SIZE; exec lightning-plugins {finetune}")  # fmt: skip
    # The launch config is found where the package is installed (`lightning-plugins recipes --where accelerate_configs`);
    # its node and process counts are replaced by the flags.
    config = f'"$(lightning-plugins recipes --where accelerate_configs)/{accelerate_config(job.nodes)}"'
    world = shlex.join(["--num_machines", str(job.nodes), "--num_processes", str(job.nodes * job.gpus_per_node)])
    rest = shlex.join(["--rdzv_backend", "c10d", "-m", "lightning_plugins.accelerate", job.recipe, *overrides])
    return (f"exec accelerate launch --config_file {config} {world} --machine_rank {node_rank}"
            f" --main_process_ip {master_addr} --main_process_port {master_port} {rest}")


def nodes_script(job: Job) -> str:
    """A bash script every node runs: ``NODE_RANK=<0..nodes-1> MASTER_ADDR=<node 0's address> bash job.sh``."""
    command = node_command(job, '"$NODE_RANK"', '"$MASTER_ADDR"', '"${MASTER_PORT:-%d}"' % PORT)
    return f"""#!/bin/bash
# {job.recipe} on {job.nodes} node(s) x {job.gpus_per_node} GPUs through the {job.door} door: run this on every node,
#   NODE_RANK=<0..{job.nodes - 1}> MASTER_ADDR=<node 0's address> [MASTER_PORT={PORT}] bash {job.name}.sh
# Written by `lightning-plugins launch`. {PREEMPTION[job.door]}
set -euo pipefail
: "${{NODE_RANK:?set NODE_RANK (0 on the node at MASTER_ADDR)}}" "${{MASTER_ADDR:?set MASTER_ADDR}}"
{command}
"""


def k8s_manifest(job: Job, image: str, pvc: str | None = None, hf_secret: str | None = None) -> dict[str, Any]:
    """A Kubeflow ``PyTorchJob``: a ``Master`` pod (node 0, the rendezvous) and ``nodes - 1`` ``Worker`` pods."""
    command = node_command(job, '"$RANK"', '"$MASTER_ADDR"', '"$MASTER_PORT"', torchrun=False)
    container: dict[str, Any] = {
        "name": "pytorch",  # the name the training operator looks for
        "image": image,
        "command": ["bash", "-c", command],
        "resources": {"limits": {"nvidia.com/gpu": job.gpus_per_node}},
        "env": [{"name": "OMP_NUM_THREADS", "value": "8"}],
    }
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # NCCL and loaders need shm
    container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if pvc is not None:  # train.output_dir (relative) lands on the shared volume: resume after a restart finds it
        volumes.append({"name": "work", "persistentVolumeClaim": {"claimName": pvc}})
        container["volumeMounts"].append({"name": "work", "mountPath": "/workspace"})
        container["workingDir"] = "/workspace"
    if hf_secret is not None:  # a gated model (meta-llama/...): the token from a Secret, key `token`
        container["env"].append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": hf_secret, "key": "token"}}})

    def replica(count: int) -> dict[str, Any]:  # each its own copy: the YAML has no anchors
        spec = {"containers": [copy.deepcopy(container)], "volumes": copy.deepcopy(volumes),
                "terminationGracePeriodSeconds": GRACE_S}  # fmt: skip
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": spec}}

    replicas = {"Master": replica(1)}
    if job.nodes > 1:
        replicas["Worker"] = replica(job.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": job.name},
        "spec": {"runPolicy": {"backoffLimit": 10, "cleanPodPolicy": "None"}, "pytorchReplicaSpecs": replicas},
    }


def sbatch_script(job: Job, partition: str | None = None, time: str | None = None) -> str:
    """An ``sbatch`` script for the job's nodes and GPUs (``sbatch job.sbatch``), as ``recipes/slurm/*.sbatch``."""
    tasks = job.gpus_per_node if job.door == "lightning" else 1
    options = [f"--job-name={job.name}", f"--nodes={job.nodes}", f"--ntasks-per-node={tasks}",
               f"--gpus-per-node={job.gpus_per_node}", "--exclusive", "--output=%x-%j.out", "--signal=USR1@120",
               "--requeue"]  # fmt: skip
    options += [f"--partition={partition}"] if partition else []
    options += [f"--time={time}"] if time else []
    header = "\n".join(f"#SBATCH {option}" for option in options)
    overrides = [f"--{o}" for o in job.overrides]
    if job.door == "lightning":  # one task per GPU: Lightning's SLURMEnvironment reads each task's rank
        finetune = shlex.join(["python", "-m", "lightning_plugins", "finetune", job.recipe, f"--hardware.nodes={job.nodes}",
                               f"--hardware.devices={job.gpus_per_node}", "--hardware.accelerator=gpu", *overrides])  # fmt: skip
        body = f"srun --kill-on-bad-exit=1 {finetune}"
        how = "srun starts one task per GPU; Lightning's SLURMEnvironment reads the ranks."
    else:  # one `accelerate launch` per node; SLURM_NODEID is each node's, hence the single quotes
        command = shlex.quote('trap "" USR1; ' + node_command(job, '"$SLURM_NODEID"', '"$MAIN_IP"', '"$MAIN_PORT"'))
        body = ('MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # the rendezvous: the first node\n'
                f"export MAIN_IP MAIN_PORT=${{MAIN_PORT:-{PORT}}}\n"
                f"srun --kill-on-bad-exit=1 bash -c {command}")
        how = ("srun runs one `accelerate launch` per node (c10d rendezvous on the first node); the launcher ignores"
               "\n# SIGUSR1, which SLURM delivers to every process of the step: the workers save and exit.")
    return f"""#!/bin/bash
# {job.recipe} on {job.nodes} node(s) x {job.gpus_per_node} GPUs through the {job.door} door: sbatch {job.name}.sbatch
# Written by `lightning-plugins launch --to slurm`. {how}
# 120 s before the time limit every task gets SIGUSR1 (train.preempt_signals): the ranks finish their step, write
# checkpoints/step=N.ckpt, rank 0 runs `scontrol requeue`, and the requeued job resumes from that checkpoint.
{header}
set -euo pipefail
export OMP_NUM_THREADS=$(( ${{SLURM_CPUS_ON_NODE:-{job.gpus_per_node}}} / {job.gpus_per_node} ))
{body}
"""


#: Where a SkyPilot task's bucket is mounted: the working directory of the run (``train.output_dir`` lands there).
SKY_WORKDIR = "/outputs"


def skypilot_task(job: Job, gpu: str, image: str | None = None, setup: str | None = None, bucket: str | None = None,
                  spot: bool = False, hf_secret: bool = False) -> dict[str, Any]:  # fmt: skip
    """A SkyPilot task: ``num_nodes`` nodes of ``gpu:gpus_per_node``, each running one launcher (node 0 the
    rendezvous), with the working directory on ``bucket`` (mounted, cached) where one is given."""
    master = '"$(echo "$SKYPILOT_NODE_IPS" | head -n1)"'
    command = node_command(job, '"$SKYPILOT_NODE_RANK"', master, str(PORT))
    resources: dict[str, Any] = {"accelerators": f"{gpu}:{job.gpus_per_node}"}
    if image:
        resources["image_id"] = f"docker:{image}"
    if spot:  # a managed job (`sky jobs launch`) recovers a preempted cluster and runs the task again
        resources["use_spot"] = True
        resources["job_recovery"] = {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 3}
    task: dict[str, Any] = {"name": job.name, "num_nodes": job.nodes, "resources": resources}
    if hf_secret:  # a gated model: `sky launch --secret HF_TOKEN` passes the caller's token
        task["secrets"] = {"HF_TOKEN": None}
    if bucket:
        task["file_mounts"] = {SKY_WORKDIR: {"source": bucket, "mode": "MOUNT_CACHED"}}
    if setup or not image:
        task["setup"] = setup or 'pip install "torch==2.13.0" lightning_plugins'
    cd = f"cd {SKY_WORKDIR}\n" if bucket else ""
    task["run"] = f"set -euo pipefail\n{cd}{command}\n"
    return task


#: What ``--submit`` runs for each target, with the written file last.
SUBMIT = {"slurm": ["sbatch"], "k8s": ["kubectl", "apply", "-f"], "skypilot": ["sky", "launch", "--yes", "--cluster"]}


def submit_command(target: str, path: str, name: str, spot: bool = False) -> list[str]:
    """The command that submits the written job (``sky jobs launch`` for a managed, preemptible SkyPilot job)."""
    if target == "skypilot":
        return ["sky", "jobs", "launch", "--yes", "--name", name, path] if spot else [*SUBMIT[target], name, path]
    return [*SUBMIT[target], path]


class _Dumper(yaml.SafeDumper):
    """YAML with a multi-line string (a task's ``run``) as a literal block."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))  # fmt: skip


def to_yaml(data: dict[str, Any]) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=1000)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a recipe file or a shipped recipe's id, e.g. llama-3.1-70b/full_tp8_fsdp4")
    parser.add_argument("--to", choices=TARGETS, required=True,
                        help="slurm: an sbatch script; torchrun: a bash script each node runs; k8s: a Kubeflow PyTorchJob"
                        " manifest; skypilot: a SkyPilot task")  # fmt: skip
    parser.add_argument("--door", choices=DOORS, default="lightning", help="lightning-plugins finetune (default) or"
                        " accelerate launch")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe's hardware.nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the recipe's hardware.devices")
    parser.add_argument("--name", default=None, help="the job's name (default: from the recipe's id)")
    parser.add_argument("--image", default=None, help="k8s (required with --submit), skypilot: a container image with"
                        " torch and lightning_plugins installed")  # fmt: skip
    parser.add_argument("--pvc", default=None, help="k8s: a PersistentVolumeClaim mounted as the working directory,"
                        " where train.output_dir and its checkpoints live (resume after a restart)")  # fmt: skip
    parser.add_argument("--hf-secret", default=None, help="k8s: a Secret whose key `token` is an HF token (gated models);"
                        " skypilot: any value, the task then asks for HF_TOKEN (sky launch --secret HF_TOKEN)")  # fmt: skip
    parser.add_argument("--partition", default=None, help="slurm: #SBATCH --partition")
    parser.add_argument("--time", default=None, help="slurm: #SBATCH --time (e.g. 2-00:00:00)")
    parser.add_argument("--gpu", default=None, help="skypilot: the accelerator name (default: the recipe's hardware.gpu)")
    parser.add_argument("--setup", default=None, help="skypilot: the setup command (default: pip install torch and"
                        " lightning_plugins; none with --image)")  # fmt: skip
    parser.add_argument("--bucket", default=None, help="skypilot: a bucket (s3://..., gs://...) mounted as the working"
                        " directory on every node, where train.output_dir and its checkpoints live (resume)")  # fmt: skip
    parser.add_argument("--spot", action="store_true", help="skypilot: spot instances, submitted as a managed job that"
                        " SkyPilot recovers after a preemption (sky jobs launch)")  # fmt: skip
    parser.add_argument("--out", default=None, help="write the job here (default: print it; with --submit: NAME.sbatch"
                        " or NAME.yaml)")  # fmt: skip
    parser.add_argument("--submit", action="store_true", help="submit the written job: sbatch (slurm), kubectl apply"
                        " (k8s), sky launch (skypilot; sky jobs launch with --spot)")  # fmt: skip


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """``lightning-plugins launch``: check the recipe for the world, then write the job. Returns the exit status."""
    from lightning_plugins.errors import RecipeError
    from lightning_plugins.recipe.schema import load_recipe
    from lightning_plugins.resources import find_recipe, recipes_dir

    try:
        path = find_recipe(args.recipe)
        hardware = load_recipe(path, overrides).hardware
        nodes = args.nodes or hardware.nodes
        gpus = args.gpus_per_node or hardware.devices
        world = [f"hardware.nodes={nodes}", f"hardware.devices={gpus}", "hardware.accelerator=gpu"]
        load_recipe(path, [*overrides, *world])  # the layout fills this world, or the error says why
    except RecipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        shipped = path.resolve().relative_to(recipes_dir().resolve()).with_suffix("").as_posix()
    except ValueError:
        shipped = None
    recipe = shipped or args.recipe  # a shipped id runs wherever the package is installed
    name = args.name or (shipped or Path(args.recipe).stem).replace("/", "-").replace("_", "-").replace(".", "-").lower()
    job = Job(recipe, nodes, gpus, args.door, tuple(overrides), name)
    if args.submit and args.to == "torchrun":
        print("error: --submit: a torchrun script has no scheduler to submit to; run it on every node", file=sys.stderr)
        return 2
    if args.to == "k8s" and args.image is None and args.submit:
        print("error: --to k8s --submit needs --image: a container image with torch and lightning_plugins installed",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.to == "slurm":
        text = sbatch_script(job, args.partition, args.time)
    elif args.to == "torchrun":
        text = nodes_script(job)
    elif args.to == "k8s":
        text = to_yaml(k8s_manifest(job, args.image or "YOUR_IMAGE", args.pvc, args.hf_secret))
    else:
        task = skypilot_task(job, args.gpu or hardware.gpu or "H100", args.image, args.setup, args.bucket, args.spot,
                             args.hf_secret is not None)  # fmt: skip
        text = to_yaml(task)
    out = args.out or (None if not args.submit else f"{name}.sbatch" if args.to == "slurm" else f"{name}.yaml")
    if out is None:
        print(text, end="")
        return 0
    Path(out).write_text(text)
    print(f"wrote {out}: {job.recipe} on {nodes} node(s) x {gpus} GPUs ({args.door} door)", file=sys.stderr)
    if not args.submit:
        return 0
    command = submit_command(args.to, out, name, args.spot)
    if shutil.which(command[0]) is None:
        print(f"error: --submit runs `{command[0]}`, which is not on PATH here: submit {out} from a machine that has it"
              f" ({shlex.join(command)})", file=sys.stderr)  # fmt: skip
        return 127
    print(f"submitting: {shlex.join(command)}", file=sys.stderr)
    return subprocess.run(command).returncode
