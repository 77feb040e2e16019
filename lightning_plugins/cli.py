"""The console script: ``lightning-plugins demo | finetune | plan | tiny | export | verify``
(also ``python -m lightning_plugins ...``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _overrides(extra: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--section.key=value`` or ``--section.key value`` arguments as ``section.key=value`` strings."""
    overrides, rest = [], list(extra)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            parser.error(
                f"unrecognized argument {arg!r}: recipe overrides look like --section.key=value (e.g. --lora.r=32)"
            )
        if "=" in arg:
            overrides.append(arg[2:])
        elif rest:
            overrides.append(f"{arg[2:]}={rest.pop(0)}")
        else:
            parser.error(f"{arg} needs a value (e.g. {arg}=VALUE)")
    return overrides


def main(argv: Sequence[str] | None = None) -> None:
    from lightning_plugins.recipe.diff import add_reset_argument, reset_overrides

    parser = argparse.ArgumentParser(prog="lightning-plugins", description=__doc__)
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
    finetune = commands.add_parser(
        "finetune",
        help="fine-tune as a recipe YAML says (overrides: --section.key=value, e.g. --lora.r=32 --train.max_steps=200)",
    )
    finetune.add_argument("recipe", help="the recipe file, e.g. recipes/tiny/lora_tp2.yaml")
    finetune.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    finetune.add_argument(
        "--resume", default=None, help="a checkpoint to resume from (default: the latest in the output directory)"
    )
    add_reset_argument(finetune)
    plan = commands.add_parser(
        "plan",
        help="check a recipe's layout at real size (memory per GPU, step time), or search the layouts of a model",
    )
    from lightning_plugins.planner.command import add_arguments

    add_arguments(plan)
    tiny = commands.add_parser(
        "tiny",
        help="write a recipe's tiny twin (its model family shrunk, its layout kinds on <= 4 CPU processes) to run here",
    )
    tiny.add_argument("recipe", help="a real-size recipe, e.g. recipes/llama-3.1-70b/lora_fsdp8.yaml")
    tiny.add_argument("--out", default=None, help="where to write it (default: outputs/tiny/<model>/<recipe name>)")
    tiny.add_argument("--steps", type=int, default=20, help="optimizer steps of the tiny run (default: 20)")
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
        "verify", help="check a training checkpoint's files against its checksums.json (exit 1 naming what differs)"
    )
    verify.add_argument("checkpoint", help="a checkpoint directory, e.g. outputs/x/checkpoints/step=100.ckpt")
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

        sys.exit(plan_main(args, _overrides(extra, plan)))
    elif args.command == "tiny":
        _tiny(args, _overrides(extra, tiny))
    elif args.command == "export":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _export(args, export)
    elif args.command == "verify":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _verify(args.checkpoint)
    elif args.command == "finetune":
        from lightning_plugins.recipe.schema import load_recipe
        from lightning_plugins.errors import RecipeError

        from lightning_plugins.checkpoint.checks import check_resume_path
        from lightning_plugins.errors import CheckpointError

        try:
            recipe = load_recipe(args.recipe, [*_overrides(extra, finetune), *reset_overrides(args)])
            if args.resume is not None:
                check_resume_path(args.resume)
        except (RecipeError, CheckpointError) as err:
            sys.exit(f"error: {err}")
        if args.print_config:
            print(recipe.to_yaml(), end="")
            return
        from lightning_plugins.strategies.runner import _say, is_launcher_rank, run_finetune
        from lightning_plugins.recipe.preflight import check_here
        from lightning_plugins.recipe.diff import check_resume
        from lightning_plugins.checkpoint.resume_choice import handed_down_resume
        from lightning_plugins.run.lock import take_run_lock
        from lightning_plugins.errors import RunLockError

        launching, lock = is_launcher_rank(), None
        try:
            check_here(recipe, args.recipe)
            # One run per output directory, taken by the rank that starts the others (before any is started).
            if launching and _global_rank() == 0:
                lock = take_run_lock(recipe.train.output_dir)
            # One resume decision per job: the launching rank's, handed down to the ranks it starts.
            resume = args.resume or handed_down_resume(recipe.train.output_dir, _say if launching else None, launching)
            recipe = check_resume(recipe, resume, _say if launching else None)
        except (RecipeError, RunLockError) as err:
            if lock is not None:  # now: the caller may go on (a test, a notebook)
                lock.release()
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
    except (ExportError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print(f"wrote {out}")


def _verify(checkpoint: str) -> None:
    from pathlib import Path

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
    print(f"{checkpoint}: every file matches its checksum")


def _tiny(args: argparse.Namespace, overrides: list[str]) -> None:
    from pathlib import Path

    from lightning_plugins.errors import RecipeError
    from lightning_plugins.recipe.tiny import shrink_recipe

    source = Path(args.recipe)
    out = Path(args.out or Path("outputs") / "tiny" / source.parent.name / source.stem)
    try:
        recipe = shrink_recipe(source, out, steps=args.steps, overrides=tuple(overrides))
    except RecipeError as err:
        sys.exit(f"error: {err}")
    from lightning_plugins.recipe.schema import load_recipe

    world = load_recipe(recipe).hardware.world_size
    print(f"wrote {recipe} and its model; run it through either door:")
    print(f"  lightning-plugins finetune {recipe}")
    print(f"  accelerate launch --config_file accelerate_configs/cpu_{world}proc.yaml -m lightning_plugins.accelerate {recipe}")


if __name__ == "__main__":
    main()
