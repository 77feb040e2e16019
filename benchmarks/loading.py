"""Host memory and time of loading a checkpoint, per rank, as the ranks grow: what a recipe's load costs each process.

Each rank runs what both doors run for a recipe: ``build_model`` (the model on the meta device; LoRA adapters built
real; QLoRA's base as NF4 of the right sizes), then ``parallelize_and_load`` (the layout, FSDP2 over every rank, and
the rank's slices read from the safetensors files). Reported per method and world size: each rank's peak resident
memory above its own baseline (the process after its imports, before the model is built), as a multiple of the
checkpoint's bytes and of the checkpoint's bytes per rank, and the load's time next to the time to read the same bytes
from disk once (``cat > /dev/null``, page cache dropped where the machine allows; the ranks read from the page cache).

Run: ``python benchmarks/loading.py`` (defaults: a ~248M-parameter Llama saved in bf16, methods full, lora, qlora
and lora from a hub id in a local cache, 2, 4 and 8 ranks). ``--json FILE`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lightning_plugins.testing.bench import Timed, add_report_arguments, machine, print_run, write_json
from lightning_plugins.testing.models import tiny_llama
from lightning_plugins.testing.world import world_rows

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny" / "lora_fsdp2_chat.yaml"
REPO_ID = "benchmark/llama"


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _rank(rank: int, directory: str, method: str, world: int, hub_cache: str | None, out: str) -> None:
    import torch.distributed as dist

    from lightning_plugins.checkpoint.load import parallelize_and_load
    from lightning_plugins.parallel.hf_model import hf_model_of
    from lightning_plugins.recipe.build import build_model
    from lightning_plugins.recipe.schema import load_recipe

    path = directory
    if hub_cache is not None:  # the id resolves to its snapshot in this cache, offline
        import huggingface_hub

        huggingface_hub.constants.HF_HUB_CACHE = hub_cache
        huggingface_hub.constants.HF_HUB_OFFLINE = True
        path = REPO_ID
    overrides = [f"model.path={path}", "model.dtype=bf16", f"layout.dp_shard_size={world}", f"hardware.devices={world}",
                 "train.micro_batch_size=1", f"train.global_batch_size={world}"]  # fmt: skip
    if method == "full":
        overrides.append("lora=null")
    elif method == "qlora":
        overrides.append("lora.quantize=nf4")
    recipe = load_recipe(RECIPE, overrides)
    baseline = _status_kib("VmRSS")
    start = time.perf_counter()
    model, _ = build_model(recipe)
    mesh = recipe.layout.resolve(world).build_mesh()
    parallelize_and_load(model, hf_model_of(model), mesh, None, None, load_from=None, owner="benchmark")
    seconds = time.perf_counter() - start
    peak = (_status_kib("VmHWM") - baseline) * 1024
    rows = [None] * world
    dist.all_gather_object(rows, {"rank": rank, "peak_bytes": peak, "seconds": seconds})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _save_checkpoint(directory: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import AutoModelForCausalLM

    config = tiny_llama(hidden, layers, hidden // 64, hidden // 256, vocab, 2048, 4 * hidden)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "recipes" / "tiny" / "model" / file, directory / file)
    return params


def _cache(root: Path, directory: Path) -> Path:
    """``directory`` as the Hugging Face cache holds a downloaded :data:`REPO_ID`."""
    revision = "0" * 40
    repo = root / f"models--{REPO_ID.replace('/', '--')}"
    shutil.copytree(directory, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return root


def _disk_read_seconds(directory: Path) -> float:
    files = sorted(str(f) for f in directory.glob("*.safetensors"))
    try:  # drop the page cache, so the read is the disk's (root only; else it reads the page cache)
        subprocess.run(["sh", "-c", "sync; echo 1 > /proc/sys/vm/drop_caches"], check=True, capture_output=True)
    except (subprocess.CalledProcessError, OSError):
        pass
    start = time.perf_counter()
    subprocess.run(["sh", "-c", f"cat {' '.join(files)} > /dev/null"], check=True)
    return time.perf_counter() - start


def measure(
    methods: list[str], worlds: list[int], hidden: int = 1024, layers: int = 12, vocab: int = 32000
) -> list[dict]:
    """One row per (method, world size): the largest rank's peak above its baseline, and the slowest rank's time."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp, "model")
        params = _save_checkpoint(directory, hidden, layers, vocab)
        checkpoint = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        hub = _cache(Path(tmp, "hub"), directory) if "lora_hub_id" in methods else None
        disk = _disk_read_seconds(directory)
        for method in methods:
            for world in worlds:
                cache = str(hub) if method == "lora_hub_id" else None
                ranks = world_rows(_rank, world, str(directory), method.removesuffix("_hub_id"), world, cache)
                peak = max(r["peak_bytes"] for r in ranks)
                seconds = max(r["seconds"] for r in ranks)
                rows.append({
                    "method": method, "ranks": world, "params": params, "checkpoint_bytes": checkpoint,
                    "peak_bytes": peak, "peak_vs_checkpoint": peak / checkpoint,
                    "peak_vs_checkpoint_per_rank": peak / (checkpoint / world), "load_s": seconds,
                    "disk_read_s": disk, "load_vs_disk_read": seconds / disk,
                })  # fmt: skip
                print(_row(rows[-1]), flush=True)
    return rows


def _row(row: dict) -> str:
    mib = 2**20
    return (
        f"| {row['method']} | {row['ranks']} | {row['peak_bytes'] / mib:.0f} | {row['peak_vs_checkpoint']:.2f} |"
        f" {row['peak_vs_checkpoint_per_rank']:.2f} | {row['load_s']:.1f} | {row['disk_read_s']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["full", "lora", "qlora", "lora_hub_id"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    add_report_arguments(parser, json_out=True)
    args = parser.parse_args()
    print("| method | ranks | peak MiB/rank above baseline | x checkpoint | x checkpoint/ranks | load s | disk read s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with Timed() as run:
        rows = measure(args.methods, args.ranks, args.hidden, args.layers, args.vocab)
    print_run(run.elapsed, machine(run.load))
    write_json(args.json, rows)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
