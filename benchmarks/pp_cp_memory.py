"""Pipeline x context parallelism: memory per rank against sequence length, from the planner's dry run at real size.

For PP=2 x CP=2 (4 GPUs), PP=2 alone (2 GPUs), CP=2 alone (2 GPUs) and, for the same 4 GPUs, CP=4, a full fine-tune of a shipped model config
(default Llama-3.1-8B, bf16 weights and AdamW state, one row per micro-batch) is dry-run
(:func:`lightning_plugins.planner.dryrun.dry_runs`: the real-size model on a fake process group of the layout's world
size, one training step under ``FakeTensorMode`` measured by the planner's tracker, extrapolated from copies with
:data:`~lightning_plugins.planner.dryrun.MEASURED_LAYERS` decoder layers per rank) over a doubling range of sequence
lengths, with activation checkpointing off and full. Pipelines run 1F1B with 2 micro-batches of one row (the fewest
that keep both stages busy; the dry run's peak is the same for more, see ``_fewer_microbatches``); CP runs ring
attention (``--cp-backend``) and, as in every layout of the engine, FSDP2 over the cp ranks. Per layout and
sequence length it reports the worst rank kind's peak and, per rank kind, the activations at its peak.

Then, per layout and checkpointing, the longest sequence whose peak fits ``--budget-gib`` per GPU: doubling from the
longest measured length that fits until one does not, then bisection on multiples of ``--resolution`` tokens, every
probe a dry run (the layouts' probes run together in one pool of processes).

    python benchmarks/pp_cp_memory.py                              # 8B, 4K..128K, AC none and full, 80 GiB
    python benchmarks/pp_cp_memory.py --seqs 4096 8192 --ac none --no-fit
    python benchmarks/pp_cp_memory.py --tiny-check                 # also one PP2 x CP2 point against a real run
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions
from lightning_plugins.planner.dryrun import RankMemory, dry_runs
from lightning_plugins.planner.workload import Workload
from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_json

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@dataclass(frozen=True)
class Setting:
    """One layout with one checkpointing mode."""

    name: str
    pp: int
    cp: int
    ac: str

    @property
    def gpus(self) -> int:
        return self.pp * self.cp


#: name -> (pp, cp); CP4 is the same 4 GPUs as PP2 x CP2 spent on context parallelism alone.
LAYOUTS = {"PP2 x CP2": (2, 2), "PP2": (2, 1), "CP2": (1, 2), "CP4": (1, 4)}


def workload(config: Any, setting: Setting, seq: int, backend: str) -> Workload:
    """The dry run's workload of ``setting`` at ``seq`` tokens: one row per (micro-)batch, bf16."""
    pp, cp = setting.pp, setting.cp
    options = ParallelOptions(cp_backend=backend, pp_schedule="1f1b", pp_microbatches=pp if pp > 1 else None)
    return Workload(
        config,
        ParallelLayout(pp_size=pp, cp_size=cp).resolve(pp * cp),
        options,
        MemoryOptions(activation_checkpointing=setting.ac),
        dtype="bf16",
        seq_len=seq,
        micro_batch_size=pp,  # split into pp micro-batches of one row
    )


def summary(ranks: list[RankMemory]) -> dict[str, Any]:
    """The worst rank kind's peak; per rank kind its peak, what it holds at it, and the most activations it holds.

    The step's peak may fall where few activations are alive (the head's logits, the optimizer step), so the
    activations per rank are the most held at any interval's peak (``RankMemory.intervals``), not those at the peak.
    An interval's categories are extrapolated one by one from the two measured copies, which can split the same
    bytes differently between activations and temporaries; a negative temporaries entry is such a shift and is
    taken back from the activations.
    """
    worst = max(ranks, key=lambda rank: rank.total)
    return {
        "peak_gib": worst.total / GIB,
        "worst_kind": worst.kind,
        "kinds": {
            rank.kind: {
                "peak_gib": rank.total / GIB,
                "activations_at_peak_gib": rank.peak["activations"] / GIB,
                "temporaries_at_peak_gib": rank.peak["temporaries"] / GIB,
                "activations_gib": max(i["activations"] + min(0, i["temporaries"]) for i in rank.intervals) / GIB,
                "state_gib": sum(rank.state.values()) / GIB,
            }
            for rank in ranks
        },
    }


def sweep(config: Any, settings: list[Setting], seqs: list[int], backend: str) -> dict[tuple[str, int], Any]:
    """Every setting at every length, in one pool of dry runs."""
    keys = [(s, seq) for s in settings for seq in seqs]
    results = dry_runs([workload(config, s, seq, backend) for s, seq in keys])
    return {(f"{s.name}|{s.ac}", seq): summary(ranks) for (s, seq), ranks in zip(keys, results)}


def longest_fitting(
    config: Any,
    settings: list[Setting],
    measured: dict[tuple[str, int], Any],
    budget: float,
    resolution: int,
    max_seq: int,
    backend: str,
) -> dict[str, dict[str, Any]]:
    """Per setting the longest multiple of ``resolution`` whose peak fits ``budget`` bytes (doubling, then bisection).

    Every setting's next probe is dry-run in the same pool; ``probes`` records each (length, peak GiB).
    """
    state: dict[str, dict[str, Any]] = {}
    for s in settings:
        key = f"{s.name}|{s.ac}"
        peaks = sorted((seq, r["peak_gib"]) for (k, seq), r in measured.items() if k == key)
        fits = [seq for seq, peak in peaks if peak * GIB <= budget]
        misses = [seq for seq, peak in peaks if peak * GIB > budget]
        low = max(fits, default=0)
        high = min((seq for seq in misses if seq > low), default=None)
        state[key] = {"setting": s, "low": low, "high": high, "probes": []}
    while True:
        probes = []
        for entry in state.values():
            low, high = entry["low"], entry["high"]
            if high is None:
                seq = 2 * max(low, resolution)
                if seq > max_seq:
                    continue
            elif high - low <= resolution:
                continue
            else:
                seq = (low + high) // 2 // resolution * resolution
            probes.append((entry, seq))
        if not probes:
            break
        results = dry_runs([workload(config, entry["setting"], seq, backend) for entry, seq in probes])
        for (entry, seq), ranks in zip(probes, results):
            peak = max(rank.total for rank in ranks)
            entry["probes"].append((seq, peak / GIB))
            if peak <= budget:
                entry["low"] = seq
            else:
                entry["high"] = seq
        print(f"  probes: {[(e['setting'].name, e['setting'].ac, seq) for e, seq in probes]}", flush=True)
    return {
        key: {"longest": e["low"], "first_over": e["high"], "probes": e["probes"], "gpus": e["setting"].gpus}
        for key, e in state.items()
    }


def tiny_check(backend: str) -> dict[str, Any]:
    """PP2 x CP2 on the small model of ``lightning_plugins/testing/memory_layouts.py``: the dry run's peak per rank kind
    next to a real gloo run."""
    from transformers import LlamaConfig

    from lightning_plugins.planner.dryrun import dry_run
    from lightning_plugins.testing.memory_layouts import CONFIG, SEQ_LEN, MemoryLayout
    from lightning_plugins.testing.world import run_world

    spec = MemoryLayout(
        4,
        ParallelLayout(pp_size=2, cp_size=2),
        ParallelOptions(cp_backend=backend, pp_schedule="1f1b", pp_microbatches=2),
    )
    predicted = dry_run(
        Workload(
            LlamaConfig(**CONFIG),
            spec.layout.resolve(4),
            spec.options,
            spec.memory,
            dtype="fp32",
            seq_len=SEQ_LEN,
            micro_batch_size=spec.rows,
        )
    )
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_tiny_rank, 4, spec, out_dir)
        real = {rank: json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(4)}
    rows = []
    for rank in predicted:
        truth = real[rank.rank]["peak"]
        rows.append(
            {
                "kind": rank.kind,
                "rank": rank.rank,
                "predicted_mib": rank.total / 2**20,
                "measured_mib": truth["total"] / 2**20,
                "predicted_act_mib": rank.peak["activations"] / 2**20,
                "measured_act_mib": truth["activations"] / 2**20,
            }
        )
    return {"model": CONFIG, "seq_len": SEQ_LEN, "rows_per_step": spec.rows, "ranks": rows}


def _tiny_rank(rank: int, world_size: int, spec: Any, out_dir: str) -> None:
    from lightning_plugins.testing.memory_layouts import measure_layout

    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(measure_layout(spec)))


def _table(settings: list[Setting], seqs: list[int], measured: dict[tuple[str, int], Any]) -> list[str]:
    lines = [
        "| layout | GPUs | AC | seq | activations GiB/rank, most held (per kind) | peak GiB/rank (worst kind)"
        " | at that peak: activations / temporaries | state GiB/rank |",
        "|---|---:|---|---:|---|---:|---|---:|",
    ]
    for s in settings:
        for seq in seqs:
            r = measured[(f"{s.name}|{s.ac}", seq)]
            kinds = "; ".join(f"{kind}: {k['activations_gib']:.1f}" for kind, k in r["kinds"].items())
            worst = r["kinds"][r["worst_kind"]]
            state = max(k["state_gib"] for k in r["kinds"].values())
            lines.append(
                f"| {s.name} | {s.gpus} | {s.ac} | {seq // 1024}K | {kinds} | **{r['peak_gib']:.1f}** ({r['worst_kind']})"
                f" | {worst['activations_at_peak_gib']:.1f} / {worst['temporaries_at_peak_gib']:.1f} | {state:.1f} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Llama-3.1-8B", help="a config directory under recipes/configs")
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096 * 2**i for i in range(6)])
    parser.add_argument("--ac", nargs="+", default=["none", "full"], choices=["none", "full"])
    parser.add_argument("--cp-backend", default="ring", choices=["ring", "ulysses"])
    parser.add_argument("--budget-gib", type=float, default=80.0, help="per-GPU budget for the peak of tensors")
    parser.add_argument("--resolution", type=int, default=1024, help="bisection step (a multiple of 2 x cp = 8)")
    parser.add_argument("--max-seq", type=int, default=2**20, help="stop doubling past this length")
    parser.add_argument("--no-fit", action="store_true", help="skip the longest-sequence search")
    parser.add_argument("--tiny-check", action="store_true", help="also check PP2 x CP2 at tiny size on gloo")
    add_report_arguments(parser, out=True)
    args = parser.parse_args()
    if args.resolution % 8:
        parser.error("--resolution must be a multiple of 8 (CP's load-balanced layout pads to 2 x cp, cp up to 4)")

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "recipes" / "configs" / args.model)
    settings = [Setting(name, pp, cp, ac) for ac in args.ac for name, (pp, cp) in LAYOUTS.items()]
    with Timed() as run:
        measured = sweep(config, settings, args.seqs, args.cp_backend)
    print("\n".join(_table(settings, args.seqs, measured)), flush=True)
    record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "sweep_s": run.elapsed}
    record["sweep"] = {f"{key}|{seq}": value for (key, seq), value in measured.items()}
    if not args.no_fit:
        with Timed() as fitting:
            fits = longest_fitting(
                config, settings, measured, args.budget_gib * GIB, args.resolution, args.max_seq, args.cp_backend
            )
        record["fit"], record["fit_s"] = fits, fitting.elapsed
        print(f"\nLongest sequence under {args.budget_gib:g} GiB per GPU (multiples of {args.resolution}):")
        print(
            "| layout | GPUs | AC | longest seq | first over | probes (seq: peak GiB) |\n|---|---:|---|---:|---:|---|"
        )
        for key, fit in fits.items():
            name, ac = key.split("|")
            probes = ", ".join(f"{seq}: {peak:.1f}" for seq, peak in fit["probes"])
            print(f"| {name} | {fit['gpus']} | {ac} | {fit['longest']} | {fit['first_over']} | {probes} |")
    if args.tiny_check:
        record["tiny_check"] = tiny_check(args.cp_backend)
        print(json.dumps(record["tiny_check"], indent=1))
    record["machine"] = machine((run.load_start, os.getloadavg()[0]))
    print_run(run.elapsed, record["machine"])
    write_json(args.out, record)


if __name__ == "__main__":
    main()
