"""``lightning-plugins plan``: check a recipe at real size, or search the layouts of a model on a cluster.

Exit status: 0 when the recipe (or the best layout found) fits, 1 when it does not, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe", nargs="?",
        help="a recipe to check at real size: a file or a shipped recipe's id (e.g. llama-3.1-8b/full_fsdp8)",
    )
    parser.add_argument("--model", help="search: a config.json, a directory holding one, or a shipped config name")
    parser.add_argument("--gpus", type=int, help="search: GPUs in all")
    parser.add_argument("--gpu", default=None, help="GPU model: H100 (default), H200, A100, A100-40GB, MI300X, ...")
    parser.add_argument("--gpu-memory", default=None, help="memory of one GPU, e.g. 80GiB (default: the GPU model's)")
    parser.add_argument(
        "--host-memory", default=None, help="host memory of a node, e.g. 1TiB (default: the recipe's, else the GPU's)"
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="search: GPUs per node (default: 8)")
    parser.add_argument("--seq-len", type=int, default=4096, help="search: tokens per row (default: 4096)")
    parser.add_argument("--method", choices=("full", "lora", "qlora"), default="full", help="search: what is trained")
    parser.add_argument("--lora-r", type=int, default=16, help="search: LoRA rank (default: 16)")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-tokens", type=int, default=None, help="search: tokens per optimizer step")
    batch.add_argument("--global-batch-size", type=int, default=None, help="search: rows per optimizer step")
    parser.add_argument("--top", type=int, default=5, help="search: layouts to show (default: 5)")
    parser.add_argument("--margin", type=float, default=0.10, help="share of GPU memory kept free (default: 0.10)")
    parser.add_argument("--no-verify", action="store_true", help="search: skip the dry run of the candidates")
    parser.add_argument("--write-recipe", default=None, help="search: write the fastest layout as a recipe YAML")
    parser.add_argument("--plot", default=None, help="write a PNG of the memory by category next to the GPU's")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--calibration",
        action="store_true",
        help="print the step-time model against the published runs it is calibrated on",
    )


def main(args: argparse.Namespace, overrides: list[str], load_recipe: Callable[[str, list[str]], Any]) -> int:
    """Run the command; returns the exit status.

    ``load_recipe(path, overrides)`` reads the recipe to check (the caller's: the planner sits below the recipe
    package, which uses it, so it does not import it).
    """
    from lightning_plugins.errors import PlannerError
    from lightning_plugins.errors import RecipeError

    try:
        if args.calibration:
            from lightning_plugins.planner.calibration import print_calibration

            print_calibration()
            return 0
        if args.recipe:
            return _check_recipe(args, load_recipe(args.recipe, overrides))
        if overrides:
            raise PlannerError(f"recipe overrides {overrides} need a recipe file")
        return _search(args)
    except (PlannerError, RecipeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _cluster(args: argparse.Namespace, gpus: int, per_node: int, gpu: str | None, memory: Any) -> Any:
    from lightning_plugins.planner.hardware import cluster_from

    return cluster_from(
        args.gpu or gpu or "H100",
        gpus=gpus,
        gpus_per_node=per_node,
        gpu_memory=args.gpu_memory or memory,
        host_memory=args.host_memory,
    )


def _check_recipe(args: argparse.Namespace, recipe: Any) -> int:
    from lightning_plugins.planner.plot import plot_plans
    from lightning_plugins.planner.report import plan_recipe

    result = plan_recipe(
        recipe,
        margin=args.margin,
        gpu=args.gpu,
        gpu_memory=args.gpu_memory,
        host_memory=args.host_memory,
    )
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.describe())
    if args.plot:
        plot_plans([result], args.plot)
    return 0 if result.fits else 1


def _search(args: argparse.Namespace) -> int:
    from lightning_plugins.adapters.lora import LoraOptions
    from lightning_plugins.planner.model_stats import load_model_config
    from lightning_plugins.errors import PlannerError
    from lightning_plugins.planner.plot import layout_label, plot_plans
    from lightning_plugins.planner.report import plan
    from lightning_plugins.planner.search import search

    if not args.model or not args.gpus:
        raise PlannerError("give a recipe to check, or --model and --gpus to search (see `lightning-plugins plan -h`)")
    config = load_model_config(args.model)
    cluster = _cluster(args, args.gpus, min(args.gpus_per_node, args.gpus), None, None)
    lora = (
        None
        if args.method == "full"
        else LoraOptions(r=args.lora_r, quantize="nf4" if args.method == "qlora" else "none")
    )
    rows = args.global_batch_size or max(1, (args.global_batch_tokens or args.gpus * args.seq_len) // args.seq_len)
    found = search(
        config,
        cluster,
        seq_len=args.seq_len,
        global_batch_size=rows,
        lora=lora,
        top=args.top,
        margin=args.margin,
        verify=not args.no_verify,
    )
    plans = [c.plan or plan(c.workload, cluster, margin=args.margin) for c in found] if args.plot else []
    if args.json:
        print(json.dumps([_candidate_dict(c) for c in found], indent=1))
    else:
        print(_table(found, cluster))
    if args.plot:
        plot_plans(plans, args.plot)
    if args.write_recipe:
        Path(args.write_recipe).write_text(recipe_yaml(found[0].workload, args.model, cluster))
        if not args.json:
            print(f"\nwrote the fastest layout ({layout_label(found[0].workload)}) to {args.write_recipe}")
    return 0


def _candidate_dict(candidate: Any) -> dict[str, Any]:
    out = {"estimated_peak": candidate.estimated_peak, "step": candidate.step.as_dict()}
    if candidate.plan is not None:
        out.update(candidate.plan.as_dict())
    else:
        layout = candidate.workload.layout
        out["layout"] = {
            "pp": layout.pp_size,
            "dp_replicate": layout.dp_replicate_size,
            "dp_shard": layout.dp_shard_size,
            "cp": layout.cp_size,
            "tp": layout.tp_size,
            "ep": layout.ep_size,
        }
    return out


def _table(found: list[Any], cluster: Any) -> str:
    from lightning_plugins.planner.rank_memory import PEAK_CATEGORIES
    from lightning_plugins.planner.plot import layout_label

    gib = 2**30
    head = (
        f"{'#':>2}  {'layout':<34}"
        + "".join(f"{c[:8]:>9}" for c in PEAK_CATEGORIES)
        + f"{'peak':>8}{'tok/s/GPU':>11}{'MFU':>7}{'bubble':>8}"
    )
    lines = [
        f"Fastest layouts that fit {cluster.gpus} x {cluster.gpu.name} ({cluster.memory / gib:.0f} GiB), GiB per GPU:",
        head,
    ]
    for index, c in enumerate(found, 1):
        if c.plan is not None:
            worst = max(c.plan.ranks, key=lambda r: r.total)
            cells = "".join(f"{worst.peak[k] / gib:>9.1f}" for k in PEAK_CATEGORIES) + f"{worst.total / gib:>8.1f}"
        else:
            cells = "".join(f"{'-':>9}" for _ in PEAK_CATEGORIES) + f"{c.estimated_peak / gib:>7.1f}*"
        lines.append(
            f"{index:>2}  {layout_label(c.workload):<34}{cells}{c.step.tokens_per_s_per_gpu:>11,.0f}{c.step.mfu:>7.1%}{c.step.bubble:>8.1%}"
        )
    if any(c.plan is None for c in found):
        lines.append("* closed-form estimate (--no-verify): not dry-run")
    return "\n".join(lines)


#: Hub organisations of the shipped configs (recipes/configs/README.md), by name prefix.
_HUB_ORGS = {"Llama-": "meta-llama", "Mistral-": "mistralai", "Qwen": "Qwen"}


def _checkpoint_of(model: str) -> str:
    """What a recipe's ``model.path`` should say for ``--model``: a local directory as given, a shipped config's
    hub id for its name."""
    path = Path(model)
    if path.exists():
        return str((path.parent if path.is_file() else path).resolve())
    org = next((org for prefix, org in _HUB_ORGS.items() if model.startswith(prefix)), None)
    return f"{org}/{model}" if org and "/" not in model else model


def recipe_yaml(workload: Any, model: str, cluster: Any) -> str:
    """A recipe for ``workload``: the layout and levers the search chose; data and schedule to fill in."""
    recipe = {
        "model": {"path": _checkpoint_of(model), "dtype": workload.dtype, "attn_implementation": "sdpa"},
        "data": {"train": "data/train.jsonl", "format": "prompt_completion", "max_seq_len": workload.seq_len},
        "layout": _fields(workload.layout),
        "parallel": _fields(workload.options),
        "memory": _fields(workload.memory),
        **({"lora": _fields(workload.lora)} if workload.lora is not None else {}),
        "optim": {"lr": 2.0e-5 if workload.lora is None else 2.0e-4, "scheduler": "cosine", "warmup_steps": 100},
        "train": {
            "global_batch_size": workload.global_batch_size,
            "micro_batch_size": workload.micro_batch_size,
            "max_steps": 1000,
            "checkpoint_every": 200,
            "output_dir": "outputs/planned",
        },
        "hardware": {
            "accelerator": "gpu",
            "devices": cluster.gpus_per_node,
            "nodes": cluster.nodes,
            "gpu": cluster.gpu.name,
            **(
                {"host_memory_gb": cluster.host_memory_per_node_bytes / 2**30}
                if cluster.host_memory_per_node_bytes is not None
                else {}
            ),
        },
    }
    header = (
        "# Written by `lightning-plugins plan`: the fastest layout that fits (dry run at real size).\n"
        "# Point data.train at your dataset and model.path at your checkpoint (or hub id) before running.\n"
    )
    return header + yaml.safe_dump(recipe, sort_keys=False)


def _fields(obj: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(obj).items() if v is not None}
