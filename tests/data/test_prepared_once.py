"""Data prepared once per node: one process tokenizes (and packs) into the cache, every rank memory-maps it.

* One launched world of 3 gloo ranks asking at once: each record is tokenized once in the whole world, every
  rank reads the same cache files, and its rows equal a single process's (packing checked against
  :func:`pack_examples`).
* The cache entry follows everything that changes the rows (max_seq_len, the chat template, the file's bytes at
  the same size): a stale entry is never read, and an unchanged input is not tokenized again.
* A writer killed half way leaves nothing that a later run reads; a damaged entry is an error naming it; a file
  system without locks still gets whole entries; an unwritable cache is an error naming the file and the directory.
* A second process that loads a prepared set of 50k (slow: 1M) records and reads every token grows its private
  memory by far less than the set's Arrow bytes: the rows are memory-mapped, not copied per rank.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from _char_tokenizer import CharTokenizer
from lightning_plugins.testing.world import run_world
from transformers import AutoTokenizer

from lightning_plugins.data import DataConfig, DataError, build_dataset, encode_chat, pack_examples, tiny_assets
from lightning_plugins.data import dataset as dataset_module

HERE = Path(__file__).resolve().parent
WORDS = ("abc", "bcd", "cdef", "defgh", "efg", "fghij", "ghi", "hij")
RECORDS = [{"prompt": f"{s}=", "completion": s[::-1]} for s in WORDS]


def _tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(tiny_assets().model_dir, local_files_only=True)


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rows(dataset: Any) -> list[dict[str, list[int]]]:
    return dataset.to_list()


def _count_encodes(set_item: Any = None) -> list[int]:
    """Prompt/completion records encoded from now on in this process (the list grows by one per record); the
    encoder is replaced through ``set_item`` (``monkeypatch.setitem``), for good in a launched rank."""
    calls: list[int] = []
    original = dataset_module.ENCODERS["prompt_completion"]

    def counting(record: Any, tokenizer: Any) -> Any:
        calls.append(1)
        return original(record, tokenizer)

    (set_item or dict.__setitem__)(dataset_module.ENCODERS, "prompt_completion", counting)
    return calls


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name != ".locks")


# ----------------------------------------------------------------------------------------------------
# Once per node, the same rows on every rank
# ----------------------------------------------------------------------------------------------------


def _prepare_on_every_rank(rank: int, world_size: int, config: DataConfig, out: str) -> None:
    import torch.distributed as dist

    calls = _count_encodes()
    tokenizer = _tokenizer()
    dist.barrier()  # every rank asks at once
    train, held = build_dataset(config, tokenizer, "train"), build_dataset(config, tokenizer, "eval")
    report = {
        "pid": os.getpid(),
        "calls": len(calls),
        "train": _rows(train),
        "eval": _rows(held),
        "files": [f["filename"] for f in train.cache_files + held.cache_files],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def test_prepared_once_and_identical_on_every_rank(tmp_path: Path) -> None:
    letters = [chr(97 + i % 26) for i in range(60)]
    records = [{"prompt": f"{c * (1 + i % 7)}=", "completion": c * (1 + i % 5)} for i, c in enumerate(letters)]
    path = _write_jsonl(tmp_path / "train.jsonl", records)
    cache = tmp_path / "cache"
    config = DataConfig(train=str(path), eval_fraction=0.25, max_seq_len=24, packing=True, cache_dir=str(cache))
    run_world(_prepare_on_every_rank, 3, config, str(tmp_path))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]

    # Each record was tokenized once in the whole world (train and eval may have had different writers).
    assert sum(r["calls"] for r in reports) == len(records), [r["calls"] for r in reports]
    entries = _entries(cache)
    assert len(entries) == 2 and not [p for p in cache.iterdir() if ".partial-" in p.name], list(cache.iterdir())
    writers = {json.loads((cache / e / "meta.json").read_text())["writer"].split(":")[1] for e in entries}
    assert writers <= {str(r["pid"]) for r in reports}
    # Every rank memory-maps the same two files of the cache.
    files = {tuple(r["files"]) for r in reports}
    assert files == {tuple(str(cache / e / "data.arrow") for e in sorted(entries, key=lambda e: "-eval-" in e))}

    # One process, another cache: the same rows; and the packed rows are pack_examples of the samples.
    alone = replace(config, cache_dir=str(tmp_path / "alone"))
    tokenizer = _tokenizer()
    train, held = _rows(build_dataset(alone, tokenizer, "train")), _rows(build_dataset(alone, tokenizer, "eval"))
    assert all(r["train"] == train and r["eval"] == held for r in reports)
    samples = _rows(build_dataset(replace(alone, packing=False), tokenizer, "train"))
    assert train == pack_examples(samples, 24)
    assert len(train) < len(samples) == 45


# ----------------------------------------------------------------------------------------------------
# The key: a stale entry is never read
# ----------------------------------------------------------------------------------------------------


def test_cache_entry_follows_everything_that_changes_the_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer, cache = _tokenizer(), tmp_path / "cache"
    path = _write_jsonl(tmp_path / "train.jsonl", RECORDS)
    config = DataConfig(train=str(path), max_seq_len=32, cache_dir=str(cache))
    calls = _count_encodes(monkeypatch.setitem)
    first = _rows(build_dataset(config, tokenizer, "train"))
    assert len(calls) == len(RECORDS) and len(_entries(cache)) == 1
    assert _rows(build_dataset(config, tokenizer, "train")) == first and len(calls) == len(RECORDS)  # read back

    short = _rows(build_dataset(replace(config, max_seq_len=6), tokenizer, "train"))
    assert len(calls) == 2 * len(RECORDS) and len(_entries(cache)) == 2
    assert max(len(row["input_ids"]) for row in short) == 6 < max(len(row["input_ids"]) for row in first)

    # The same size, other bytes, written at once (within the file system's time resolution): seen.
    size = path.stat().st_size
    _write_jsonl(path, [{"prompt": r["completion"] + "=", "completion": r["prompt"][:-1]} for r in RECORDS])
    assert path.stat().st_size == size
    changed = _rows(build_dataset(config, tokenizer, "train"))
    assert len(calls) == 3 * len(RECORDS) and len(_entries(cache)) == 3
    assert changed != first
    assert changed == _rows(build_dataset(replace(config, cache_dir=str(tmp_path / "fresh")), tokenizer, "train"))

    lines = tiny_assets().chat_eval_file.read_text().splitlines()[:6]
    chats = _write_jsonl(tmp_path / "chat.jsonl", [json.loads(line) for line in lines])
    chat = DataConfig(train=str(chats), max_seq_len=128, cache_dir=str(cache))
    before = _rows(build_dataset(chat, tokenizer, "train"))
    other = copy.deepcopy(tokenizer)
    other.chat_template = tokenizer.chat_template.replace("u:", "q:")
    after = _rows(build_dataset(chat, other, "train"))
    assert len(_entries(cache)) == 5
    records = [json.loads(line) for line in chats.read_text().splitlines()]
    assert after == [encode_chat(r, other) for r in records] != before == [encode_chat(r, tokenizer) for r in records]


# ----------------------------------------------------------------------------------------------------
# A killed writer, a damaged entry
# ----------------------------------------------------------------------------------------------------

_DIES_HALF_WAY = """
import os, signal, sys
sys.path.insert(0, {here!r})
from _char_tokenizer import CharTokenizer
from lightning_plugins.data import DataConfig, build_dataset
from lightning_plugins.data import dataset as module

original, seen = module.ENCODERS["prompt_completion"], []
def dying(record, tokenizer):
    seen.append(1)
    if len(seen) == 2500:  # two batches of 1000 rows are in the file by now
        os.kill(os.getpid(), signal.SIGKILL)
    return original(record, tokenizer)
module.ENCODERS["prompt_completion"] = dying
build_dataset(DataConfig(train={train!r}, max_seq_len=32, cache_dir={cache!r}), CharTokenizer(), "train")
"""


def test_a_killed_writer_leaves_nothing_that_is_read(tmp_path: Path) -> None:
    records = [{"prompt": f"{i}=", "completion": str(i)[::-1]} for i in range(4000)]
    path, cache = _write_jsonl(tmp_path / "train.jsonl", records), tmp_path / "cache"
    script = _DIES_HALF_WAY.format(here=str(HERE), train=str(path), cache=str(cache))
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    partial = [p for p in cache.iterdir() if ".partial-" in p.name]
    assert len(partial) == 1 and any(partial[0].iterdir()) and _entries(cache) == [partial[0].name]

    config = DataConfig(train=str(path), max_seq_len=32, cache_dir=str(cache))
    tokenizer = CharTokenizer()
    rows = build_dataset(config, tokenizer, "train")
    last = tokenizer("3999=")["input_ids"] + tokenizer("9993", add_special_tokens=False)["input_ids"] + [2]
    assert len(rows) == 4000 and rows[3999]["input_ids"] == last
    (entry,) = _entries(cache)  # the killed writer's partial directory is gone
    assert ".partial-" not in entry

    data = cache / entry / "data.arrow"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(DataError, match=rf"data.train \({path}\): the tokenized cache {cache / entry} is damaged"):
        build_dataset(config, CharTokenizer(), "train")


def test_without_file_locks_and_with_an_unwritable_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    path, tokenizer = _write_jsonl(tmp_path / "train.jsonl", RECORDS), CharTokenizer()
    expected = _rows(build_dataset(DataConfig(train=str(path), cache_dir=str(tmp_path / "locked")), tokenizer, "train"))

    def no_locks(handle: Any, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)  # e.g. NFS without a lock daemon: the rename alone keeps it safe
    config = DataConfig(train=str(path), cache_dir=str(tmp_path / "unlocked"))
    assert _rows(build_dataset(config, tokenizer, "train")) == expected
    assert _rows(build_dataset(config, tokenizer, "train")) == expected

    blocked = tmp_path / "a_file"
    blocked.write_text("")
    where = rf"data.train \({path}\): cannot write the tokenized data to the cache directory {blocked} "
    with pytest.raises(DataError, match=where):
        build_dataset(DataConfig(train=str(path), cache_dir=str(blocked)), tokenizer, "train")


# ----------------------------------------------------------------------------------------------------
# Memory: mapped, not copied
# ----------------------------------------------------------------------------------------------------

_LOAD_AND_READ_EVERYTHING = """
import json, sys
sys.path.insert(0, {here!r})
import pyarrow.compute as pc
from _char_tokenizer import CharTokenizer
from lightning_plugins.data import DataConfig, build_dataset

def memory():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {{key: int(status[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}}

def read_everything(dataset):
    table = dataset.with_format("arrow")[:]
    return sum(pc.sum(pc.list_flatten(table.column(name))).as_py() for name in table.column_names)

tokenizer = CharTokenizer()
read_everything(build_dataset(DataConfig(train={small!r}, cache_dir={cache!r}), tokenizer, "train"))  # imports, pools
before = memory()
dataset = build_dataset(DataConfig(train={train!r}, max_seq_len=64, cache_dir={cache!r}), tokenizer, "train")
loaded = memory()
total = read_everything(dataset)
print(json.dumps({{"before": before, "loaded": loaded, "read": memory(), "rows": len(dataset), "total": total,
                  "files": [f["filename"] for f in dataset.cache_files]}}))
"""


# The measurement is the kernel's own split of a process's memory (RssAnon / RssFile in /proc), which only Linux
# has; CI and every machine this project targets run Linux, so there the test always runs.
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc (Linux)")
@pytest.mark.parametrize("records", [50_000, pytest.param(1_000_000, marks=pytest.mark.slow)])
def test_a_rank_maps_the_prepared_rows_instead_of_copying_them(tmp_path: Path, records: int) -> None:
    train, cache = tmp_path / "train.jsonl", tmp_path / "cache"
    with open(train, "w") as handle:  # ~30 characters a record: ~400 bytes of token ids and labels
        for i in range(records):
            a, b = i % 9973, i % 101
            handle.write(f'{{"prompt": "what is {a} + {b}? ", "completion": "it is {a + b}."}}\n')
    small = _write_jsonl(tmp_path / "small.jsonl", RECORDS)
    tokenizer = CharTokenizer()
    build_dataset(DataConfig(train=str(small), cache_dir=str(cache)), tokenizer, "train")
    prepared = build_dataset(DataConfig(train=str(train), max_seq_len=64, cache_dir=str(cache)), tokenizer, "train")
    arrow_bytes = prepared.data.nbytes
    assert len(prepared) == records and arrow_bytes > 300 * records

    # Another rank: it only reads the cache (the small set first, so imports and arrow's pools are not counted).
    script = _LOAD_AND_READ_EVERYTHING.format(here=str(HERE), small=str(small), train=str(train), cache=str(cache))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["rows"] == records and seen["files"] == [f["filename"] for f in prepared.cache_files]
    table = prepared.with_format("arrow")[:]
    assert seen["total"] == sum(pc.sum(pc.list_flatten(table.column(name))).as_py() for name in table.column_names)
    private = {stage: seen[stage]["RssAnon"] - seen["before"]["RssAnon"] for stage in ("loaded", "read")}
    shared = seen["read"]["RssFile"] - seen["before"]["RssFile"]
    assert max(private.values()) < arrow_bytes / 10, (private, arrow_bytes)  # a copy would be arrow_bytes or more
    assert shared > arrow_bytes / 2, (shared, arrow_bytes)  # every token was read: through the shared page cache
