"""Data prepared once per node, measured: time to the dataset and each rank's memory, at 1, 2 and 4 ranks.

``--records`` short string-reversal records (``{"prompt": "fhbgb=", "completion": "bgbhf"}``, as
``recipes/tiny/data``) are tokenized by the tiny model's tokenizer (``recipes/tiny/model``). For each rank count,
that many processes (started as a launcher starts ranks; no process group, as in the Lightning door before
``trainer.fit``) call :func:`lightning_plugins.data.build_dataset` at the same moment:

* **cold**: an empty ``data.cache_dir``: one process tokenizes and writes the Arrow file, the others wait on its
  lock, then every process memory-maps it;
* **warm**: the same again, the cache written: every process only maps the file.

Printed per run: the slowest rank's seconds from the common start to its dataset, how many ranks tokenized, and
memory in MiB (``/proc/self/status``) grown from after its imports, its tokenizer and a warm-up build of 10 records
to after reading every token of the dataset (``pyarrow.compute`` over the columns): ``private`` (``RssAnon``, the
rank's own pages, where a copy of the data would be) of the writer and the largest of the other ranks, and
``mapped`` (``RssFile``, the largest: page-cache pages that every process on the node shares). ``arrow`` is the
dataset's size, which each rank held in memory before (``Dataset.map(keep_in_memory=True)`` on every rank).

Usage::

    python benchmarks/data_prepare.py                        # 100k records, 1 2 4 ranks: ~2 minutes on 2 cores
    python benchmarks/data_prepare.py --records 1000000      # 1M records: ~2 minutes more per rank count
    python benchmarks/data_prepare.py --ranks 4 --packing    # packed rows of --max-seq-len tokens
    python benchmarks/data_prepare.py --records 1000 --ranks 1 --out rows.json   # the rows as JSON too
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_rows

#: The printed columns.
COLUMNS = ("ranks", "run", "seconds", "writers", "rows", "arrow", "writer private", "others private", "mapped")


def _memory() -> dict[str, float]:
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(status[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile")}  # MiB


def worker(opts: argparse.Namespace) -> None:
    """One rank: build the dataset when the parent says go, read every token, report."""
    from dataclasses import replace

    import pyarrow.compute as pc
    from transformers import AutoTokenizer

    from lightning_plugins.data import DataConfig, build_dataset, tiny_assets

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets().model_dir, local_files_only=True)
    config = DataConfig(train=opts.data, max_seq_len=opts.max_seq_len, packing=opts.packing, cache_dir=opts.cache)
    work = Path(opts.cache).parent
    small = replace(config, train=str(work.parent / "small.jsonl"), cache_dir=str(work.parent / "small_cache"))
    build_dataset(small, tokenizer, "train").with_format("arrow")[:]  # the imports and pools, not counted below
    before = _memory()
    Path(work, f"ready{opts.rank}").touch()
    while not Path(work, "go").exists():
        time.sleep(0.005)
    start = float(Path(work, "go").read_text())
    dataset = build_dataset(config, tokenizer, "train")
    seconds = time.time() - start
    built = _memory()
    table = dataset.with_format("arrow")[:]
    checksum = sum(pc.sum(pc.list_flatten(table.column(name))).as_py() for name in table.column_names)  # every token
    read = _memory()
    meta = json.loads(Path(dataset.cache_files[0]["filename"]).with_name("meta.json").read_text())
    report = {
        "rank": opts.rank, "seconds": seconds, "wrote": meta["writer"].endswith(f":{os.getpid()}"),
        "rows": len(dataset), "checksum": checksum, "arrow": dataset.data.nbytes / 2**20,
        "private_built": built["RssAnon"] - before["RssAnon"], "private_read": read["RssAnon"] - before["RssAnon"],
        "mapped_read": read["RssFile"] - before["RssFile"],
    }  # fmt: skip
    print(json.dumps(report), flush=True)


def run_ranks(ranks: int, data: Path, cache: Path, opts: argparse.Namespace) -> list[dict]:
    """``ranks`` worker processes, released together; their reports."""
    work = cache.parent
    for stale in [*work.glob("ready*"), work / "go"]:
        stale.unlink(missing_ok=True)
    common = [sys.executable, __file__, "--worker", "--data", str(data), "--cache", str(cache),
              "--max-seq-len", str(opts.max_seq_len), *(["--packing"] if opts.packing else [])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = [
        subprocess.Popen([*common, "--rank", str(r)], stdout=subprocess.PIPE, env={**env, "LOCAL_RANK": str(r)})
        for r in range(ranks)
    ]
    while len(list(work.glob("ready*"))) < ranks:
        if any(p.poll() not in (None, 0) for p in procs):
            raise SystemExit("a worker failed before the start")
        time.sleep(0.01)
    Path(work, "go.tmp").write_text(repr(time.time()))
    Path(work, "go.tmp").rename(work / "go")  # whole, or not there: a worker never reads it half written
    reports = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a worker failed with status {p.returncode}")
        reports.append(json.loads(out.decode().splitlines()[-1]))
    return reports


def write_records(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(n):
            word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 8)))
            handle.write(json.dumps({"prompt": word + "=", "completion": word[::-1]}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--packing", action="store_true")
    add_report_arguments(parser, out=True)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        return worker(opts)
    rows = []
    with Timed() as timed, tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "train.jsonl")
        write_records(data, opts.records)
        write_records(Path(tmp, "small.jsonl"), 10)
        print(f"{opts.records} records ({data.stat().st_size / 2**20:.1f} MiB of JSON lines), max_seq_len"
              f" {opts.max_seq_len}, packing {opts.packing}; {os.cpu_count()} CPUs.")  # fmt: skip
        print(" ".join(f"{c:>{max(8, len(c))}}" for c in COLUMNS))
        for ranks in opts.ranks:
            work = Path(tmp, f"ranks{ranks}")
            work.mkdir()
            for run in ("cold", "warm"):
                rows.append(_row(ranks, run, run_ranks(ranks, data, work / "cache", opts)))
                print(" ".join(f"{v:>{max(8, len(c))}}" for v, c in zip(rows[-1].values(), COLUMNS)), flush=True)
    on = machine(timed.load)
    print_run(timed.elapsed, on)
    write_rows(opts.out, opts, on, rows)


def _row(ranks: int, run: str, reports: list[dict]) -> dict:
    """One printed row (:data:`COLUMNS`) from the workers' reports."""
    assert len({(r["rows"], r["checksum"]) for r in reports}) == 1, reports  # the same rows on every rank
    writers = [r["private_read"] for r in reports if r["wrote"]]
    others = [r["private_read"] for r in reports if not r["wrote"]]
    values = (ranks, run, f"{max(r['seconds'] for r in reports):.2f}", len(writers), reports[0]["rows"],
              f"{reports[0]['arrow']:.1f}", *(f"{max(v):.1f}" if v else "-" for v in (writers, others)),
              f"{max(r['mapped_read'] for r in reports):.1f}")  # fmt: skip
    return dict(zip(COLUMNS, values))


if __name__ == "__main__":
    main()
