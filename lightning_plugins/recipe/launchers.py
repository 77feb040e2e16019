"""``lightning-plugins launch RECIPE --to torchrun|k8s``: the job that runs a recipe on its hardware, beyond Slurm.

Slurm has its batch files (``recipes/slurm/*.sbatch``). Elsewhere a job is one launcher per node with a rendezvous,
which is what this writes, for either door:

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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

TARGETS = ("torchrun", "k8s")
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a recipe file or a shipped recipe's id, e.g. llama-3.1-70b/full_tp8_fsdp4")
    parser.add_argument("--to", choices=TARGETS, required=True,
                        help="torchrun: a bash script each node runs; k8s: a Kubeflow PyTorchJob manifest")  # fmt: skip
    parser.add_argument("--door", choices=DOORS, default="lightning", help="lightning-plugins finetune (default) or"
                        " accelerate launch")  # fmt: skip
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe's hardware.nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the recipe's hardware.devices")
    parser.add_argument("--name", default=None, help="the job's name (default: from the recipe's id)")
    parser.add_argument("--image", default="YOUR_IMAGE", help="k8s: a container image with lightning_plugins installed")
    parser.add_argument("--pvc", default=None, help="k8s: a PersistentVolumeClaim mounted as the working directory,"
                        " where train.output_dir and its checkpoints live (resume after a restart)")  # fmt: skip
    parser.add_argument("--hf-secret", default=None, help="k8s: a Secret whose key `token` is an HF token (gated models)")
    parser.add_argument("--out", default=None, help="write the script or manifest here (default: print it)")


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
    if args.to == "torchrun":
        text = nodes_script(job)
    else:
        text = yaml.safe_dump(k8s_manifest(job, args.image, args.pvc, args.hf_secret), sort_keys=False, width=1000)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}: {job.recipe} on {nodes} node(s) x {gpus} GPUs ({args.door} door)", file=sys.stderr)
    else:
        print(text, end="")
    return 0
