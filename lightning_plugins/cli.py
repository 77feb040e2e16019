"""The console script: ``lightning-plugins demo | recipes | finetune | plan | tiny | launch | export | verify``
(also ``python -m lightning_plugins ...``). A recipe is a YAML file or a shipped recipe's id (``lightning-plugins
recipes`` lists them)."""

from __future__ import annotations

import argparse
from importlib.metadata import version
import os
import sys
from collections.abc import Sequence
from pathlib import Path


#: The shipped folders ``lightning-plugins recipes --where`` names.
WHERE = ("recipes", "accelerate_configs", "slurm")
#: The recipes the help names, by command (tests/test_cli.py checks each is shipped).
EXAMPLES = {"finetune": "tiny/lora_tp2", "tiny": "llama-3.1-70b/lora_fsdp8", "plan": "llama-3.1-8b/full_fsdp8"}


def _parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line: the top-level parser and each command's, by name.

    Args:
        only: The command being run: the arguments of ``finetune``, ``plan`` and ``launch`` (whose modules import
            torch, transformers and the engine) are added only to its parser; ``None``: to every parser.
    """
    parser = argparse.ArgumentParser(prog="lightning-plugins", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('lightning_plugins')}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="fine-tune the shipped tiny Llama with TensorParallelStrategy on CPU processes"
    )
    demo.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    demo.add_argument("--tp-size", type=int, default=2, help="tensor-parallel size (default: 2)")
    demo.add_argument("--max-steps", type=int, default=400)
    demo.add_argument("--lr", type=float, default=3e-3)
    demo.add_argument("--batch-size", type=int, default=16)
    demo.add_argument("--out", default="outputs/demo", help="where the fine-tuned HF checkpoint is written")
    demo.add_argument("--eval-limit", type=int, default=None, help="evaluate on the first N held-out examples")
    recipes = commands.add_parser("recipes", help="list the shipped recipes: id, hardware, what each does")
    recipes.add_argument("--where", nargs="?", const="all", choices=("all", *WHERE), default=None,
                         help="print where the shipped files are (or one folder of them), then exit")
    finetune = commands.add_parser(
        "finetune",
        help="fine-tune as a recipe says (overrides: --section.key=value, e.g. --lora.r=32 --train.max_steps=200)",
    )
    if only in (None, "finetune"):
        from lightning_plugins.recipe.launch import add_recipe_arguments

        add_recipe_arguments(finetune, EXAMPLES["finetune"])
    plan = commands.add_parser(
        "plan",
        help="check a recipe's layout at real size (memory per GPU, step time), or search the layouts of a model",
    )
    if only in (None, "plan"):
        from lightning_plugins.planner.command import add_arguments

        add_arguments(plan)
    tiny = commands.add_parser(
        "tiny",
        help="write a recipe's tiny twin (its model family shrunk, its layout kinds on <= 4 CPU processes) to run here",
    )
    tiny.add_argument("recipe", help=f"a real-size recipe (a file or a shipped id), e.g. {EXAMPLES['tiny']}")
    tiny.add_argument("--out", default=None, help="where to write it (default: outputs/tiny/<model>/<recipe name>)")
    tiny.add_argument("--steps", type=int, default=20, help="optimizer steps of the tiny run (default: 20)")
    launch = commands.add_parser("launch", help="write (or --submit) the job that runs a recipe on its hardware:"
                                 " sbatch, torchrun, Kubernetes or SkyPilot")  # fmt: skip
    if only in (None, "launch"):
        from lightning_plugins.recipe.launchers import add_arguments as add_launch_arguments

        add_launch_arguments(launch)
    export = commands.add_parser(
        "export",
        help="turn a training checkpoint (checkpoints/step=N.ckpt) into an HF or peft directory, streaming, in one process",
    )
    export.add_argument("checkpoint", help="a checkpoint directory written by either door, e.g. outputs/x/checkpoints/step=100.ckpt")
    export.add_argument("out_dir", help="the HF (or peft adapter) directory to write; must not exist or be empty")
    export.add_argument("--merge", action="store_true", help="LoRA: merge the adapters into the base weights")
    export.add_argument("--model", default=None, help="the original model directory (config, tokenizer, base for --merge)")
    export.add_argument("--force", action="store_true", help="replace out_dir if it exists and is not empty")
    export.add_argument("--max-shard-size", default="5GB", help="bytes per safetensors file, e.g. 5GB, 500MB (default: 5GB)")
    verify = commands.add_parser(
        "verify",
        help="check a training checkpoint's files against its checksums.json, and that its pickles hold only what a"
        " checkpoint holds (exit 1 naming the file)",
    )
    verify.add_argument("checkpoint", help="a checkpoint directory, e.g. outputs/x/checkpoints/step=100.ckpt")
    return parser, commands.choices


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command is the first word that is not an option (the top level's options take no value).
    parser, commands = _parser(only=next((word for word in argv if not word.startswith("-")), ""))
    finetune, plan, tiny, export = (commands[name] for name in ("finetune", "plan", "tiny", "export"))
    args, extra = parser.parse_known_args(argv)

    if args.command == "demo":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from lightning_plugins.demo import run_demo

        run_demo(
            devices=args.devices,
            tp_size=args.tp_size,
            max_steps=args.max_steps,
            lr=args.lr,
            batch_size=args.batch_size,
            out_dir=args.out,
            eval_limit=args.eval_limit,
        )
    elif args.command == "plan":
        from lightning_plugins.planner.command import main as plan_main
        from lightning_plugins.recipe.launch import recipe_overrides
        from lightning_plugins.recipe.schema import load_recipe

        sys.exit(plan_main(args, recipe_overrides(extra, plan), load_recipe))
    elif args.command == "tiny":
        from lightning_plugins.recipe.launch import recipe_overrides

        _tiny(args, recipe_overrides(extra, tiny))
    elif args.command == "export":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _export(args, export)
    elif args.command == "verify":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _verify(args.checkpoint)
    elif args.command == "finetune":
        _finetune(args, extra, finetune)
    elif args.command == "recipes":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _recipes(where=args.where)
    elif args.command == "launch":
        from lightning_plugins.recipe.launch import recipe_overrides
        from lightning_plugins.recipe.launchers import main as launch_main

        sys.exit(launch_main(args, recipe_overrides(extra, commands["launch"])))


def _finetune(args: argparse.Namespace, extra: list[str], parser: argparse.ArgumentParser) -> None:
    """``lightning-plugins finetune``: the shared prelude (:mod:`lightning_plugins.recipe.launch`), then the run."""
    from lightning_plugins.errors import CheckpointError, RecipeError, RunLockError
    from lightning_plugins.recipe.launch import claim_run, load_run_recipe, say

    try:
        recipe = load_run_recipe(args, extra, parser)
    except (RecipeError, CheckpointError) as err:
        sys.exit(f"error: {err}")
    if args.print_config:
        print(recipe.to_yaml(), end="")
        return
    from lightning_plugins.checkpoint.resume_choice import handed_down_resume
    from lightning_plugins.strategies.runner import is_launcher_rank, run_finetune

    launching = is_launcher_rank()
    said = say if launching else None
    try:
        # One run per output directory, taken by the rank that starts the others (before any is started). One resume
        # decision per job: the launching rank's, handed down to the ranks it starts.
        recipe, resume, lock = claim_run(
            recipe, args.recipe, args.resume, take_lock=launching and _global_rank() == 0, say=said,
            decide=lambda: handed_down_resume(recipe.train.output_dir, said, launching),
        )  # fmt: skip
    except (RecipeError, RunLockError) as err:
        sys.exit(f"error: {err}")
    from lightning_plugins.data import DataError
    from lightning_plugins.errors import NonFiniteError

    try:  # the data is read on rank 0 before the other ranks start: a bad record stops it alone, at once
        result = run_finetune(recipe, resume=resume)
    except DataError as err:
        sys.exit(f"error: {args.recipe}: {err}")
    except NonFiniteError as err:  # every rank stops alike; the launcher's says why
        sys.exit(f"error: {err}" if is_launcher_rank() else 1)
    finally:
        if lock is not None:
            lock.release()
    if result and is_launcher_rank():
        print("\n".join(f"{key}: {value}" for key, value in result.items()))


def _global_rank() -> int:
    """This process's global rank where a launcher already said it (torchrun, SLURM), else 0."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from lightning_plugins.checkpoint.export import ExportError, export_checkpoint
    from lightning_plugins.errors import CheckpointError

    size = args.max_shard_size.strip().upper()
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    unit = next((u for u in units if size.endswith(u)), "")
    try:
        max_shard_size = int(float(size.removesuffix(unit)) * units.get(unit, 1))
    except ValueError:
        parser.error(f"--max-shard-size {args.max_shard_size!r}: give bytes or a size such as 5GB or 500MB")
    try:
        out = export_checkpoint(
            args.checkpoint, args.out_dir, merge=args.merge, model=args.model, force=args.force, max_shard_size=max_shard_size
        )
    except (ExportError, CheckpointError, FileNotFoundError) as err:  # a file refused by the safe readers too
        sys.exit(f"error: {err}")
    print(f"wrote {out}")


def _verify(checkpoint: str) -> None:
    from lightning_plugins.errors import CheckpointError
    from lightning_plugins.checkpoint.integrity import MANIFEST, verify_checkpoint

    if not Path(checkpoint).is_dir():
        sys.exit(f"error: {checkpoint}: no such checkpoint directory.")
    try:
        verified = verify_checkpoint(checkpoint)
    except CheckpointError as err:
        sys.exit(f"error: {err}")
    if not verified:
        sys.exit(f"error: {checkpoint} has no {MANIFEST} (written by an older version): nothing to verify it against.")
    print(f"{checkpoint}: every file matches its checksum, and its pickles hold only what a checkpoint holds")


def _tiny(args: argparse.Namespace, overrides: list[str]) -> None:

    from lightning_plugins.errors import RecipeError
    from lightning_plugins.recipe.tiny import shrink_recipe

    from lightning_plugins.resources import accelerate_configs_dir, find_recipe

    try:
        source = find_recipe(args.recipe)
        out = Path(args.out or Path("outputs") / "tiny" / source.parent.name / source.stem)
        recipe = shrink_recipe(source, out, steps=args.steps, overrides=tuple(overrides))
    except RecipeError as err:
        sys.exit(f"error: {err}")
    from lightning_plugins.recipe.schema import load_recipe

    world = load_recipe(recipe).hardware.world_size
    print(f"wrote {recipe} and its model; run it through either door:")
    print(f"  lightning-plugins finetune {recipe}")
    config = _shown(accelerate_configs_dir() / f"cpu_{world}proc.yaml")
    print(f"  accelerate launch --config_file {config} -m lightning_plugins.accelerate {recipe}")


def _shown(path: Path) -> str:
    """``path`` relative to the current directory when it is under it (``accelerate_configs/x.yaml`` in a clone)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _recipes(where: str | None) -> None:
    """``lightning-plugins recipes``: each shipped recipe's id, hardware and method, from its file (nothing built)."""
    import yaml

    from lightning_plugins.resources import accelerate_configs_dir, recipe_ids, recipes_dir, slurm_dir

    folders = {"recipes": recipes_dir(), "accelerate_configs": accelerate_configs_dir(), "slurm": slurm_dir()}
    if where == "all":
        print("\n".join(f"{name}: {folder}" for name, folder in folders.items()))
        return
    if where is not None:
        print(folders[where])
        return
    rows = []
    for name in recipe_ids():
        path = recipes_dir() / f"{name}.yaml"
        text = path.read_text()
        raw = yaml.safe_load(text) or {}
        hardware = raw.get("hardware") or {}
        devices, nodes = hardware.get("devices", 1), hardware.get("nodes", 1)
        if hardware.get("accelerator", "gpu") == "cpu":
            where_runs = f"{devices} CPU proc"
        else:
            where_runs = f"{nodes} x {devices} {hardware.get('gpu') or 'GPU'}"
        lora = raw.get("lora") or {}
        method = "full" if not lora else ("qlora" if lora.get("quantize", "none") != "none" else "lora")
        first = text.splitlines()[0] if text.startswith("#") else ""
        rows.append((name, where_runs, method, first.lstrip("# ").strip()))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    print(
        "\nRun one by id or path: lightning-plugins plan ID | tiny ID | finetune ID | launch ID --to slurm"
        " (`lightning-plugins recipes --where` says where the files are)."
    )


if __name__ == "__main__":
    main()
