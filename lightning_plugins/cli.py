"""The console script: ``lightning-plugins demo`` (also ``python -m lightning_plugins demo``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
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
    args = parser.parse_args(argv)

    if args.command == "demo":
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


if __name__ == "__main__":
    main()
