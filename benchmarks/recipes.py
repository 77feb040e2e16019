"""Every shipped recipe at its real size: the planner's dry run (memory per GPU by category, host memory) and
step-time model (tokens/s/GPU), as the table in README.md and benchmarks/RESULTS.md.

    python benchmarks/recipes.py                      # all recipes under recipes/ (not recipes/tiny)
    python benchmarks/recipes.py recipes/llama-3.1-8b/*.yaml --json out.json

Exits 1 when a recipe does not fit its hardware with the planner's 10% margin.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_plugins.planner.plot import layout_label
from lightning_plugins.planner.rank_memory import PEAK_CATEGORIES
from lightning_plugins.planner.report import plan_recipe
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_json

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def shipped_recipes() -> list[Path]:
    """The real-size recipes: ``recipes/<model>/*.yaml`` (the tiny ones excluded)."""
    return sorted(p for p in (ROOT / "recipes").glob("*/*.yaml") if p.parent.name != "tiny")


def row(path: Path) -> dict:
    with Timed() as planned:
        recipe = load_recipe(path)
        plan = plan_recipe(recipe)
    worst = max(plan.ranks, key=lambda rank: rank.total)
    hardware = recipe.hardware
    return {
        "recipe": str(path.relative_to(ROOT)),
        "hardware": f"{hardware.nodes} x {hardware.devices} {plan.cluster.gpu.name} {plan.cluster.memory / GIB:.0f}GiB",
        "layout": layout_label(plan.workload),
        "method": plan.workload.method,
        "seq_len": recipe.data.max_seq_len,
        "peak_gib": worst.total / GIB,
        "budget_gib": plan.budget / GIB,
        "categories_gib": {name: worst.peak[name] / GIB for name in PEAK_CATEGORIES},
        "host_gib_per_node": plan.host_per_node / GIB,
        "tokens_per_s_per_gpu": plan.step.tokens_per_s_per_gpu,
        "fits": plan.fits,
        "seconds": planned.elapsed,
    }


def _line(r: dict) -> str:
    c = r["categories_gib"]
    flag = "" if r["fits"] else " **does not fit**"
    return (
        f"| `{r['recipe']}` | {r['hardware']} | {r['layout']} | {r['seq_len']} | {r['peak_gib']:.1f} ({r['budget_gib']:.0f})"
        f"{flag} | {c['parameters']:.1f} | {c['gradients']:.1f} | {c['optimizer']:.1f} | {c['activations']:.1f}"
        f" | {c['temporaries']:.1f} | {r['host_gib_per_node']:.0f} | {r['tokens_per_s_per_gpu']:,.0f}"
        f" | {r['seconds']:.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", type=Path, help="recipe files (default: every shipped one)")
    add_report_arguments(parser, json_out=True)
    args = parser.parse_args()
    rows = []
    print(
        "| recipe | hardware | layout | seq | peak GiB/GPU (budget) | params | grads | optim | act | temp | host GiB/node"
        " | tok/s/GPU | dry run s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with Timed() as run:
        for path in args.recipes or shipped_recipes():
            rows.append(row(path.resolve()))
            print(_line(rows[-1]), flush=True)
    print_run(run.elapsed, machine(run.load))
    write_json(args.json, rows)
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
