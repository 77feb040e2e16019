"""A checkpoint from someone else never runs their code (issue 43): every pickle a checkpoint holds (DCP's
``.metadata``, a non-tensor entry of a data file, Lightning's ``meta.pt``, a rank's random states, the Accelerate door's
state) is replaced by one whose ``__reduce__`` writes a marker file, and ``checksums.json`` rewritten to match (whoever
can write the files can write it). ``verify`` and ``export`` stop naming the file and exit non-zero; auto-resume says
so and falls back to the previous checkpoint; ``--resume`` stops the run, naming the file; the doors' loaders and the
safe readers themselves refuse it. The marker never appears.

One run per door (one process, checkpoints every 2 steps) is shared by every case, each planting into a copy whose
newest checkpoint is step 4's; the rest runs in this process except auto-resume and ``--resume`` through each door
(one process each): six launches, the two runs shared with test_resume_changed (``_launch.shared_run``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import pickle
import re
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _launch import shared_run
from lightning_plugins.testing.world import run_command
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_plugins.accelerate.state import STATE_FILE, load_training_state
from lightning_plugins.checkpoint.integrity import MANIFEST
from lightning_plugins.checkpoint.resume import RNG_FILE, read_rng
from lightning_plugins.checkpoint.resume_choice import latest_checkpoint
from lightning_plugins.checkpoint.safe_read import (
    NUMPY_RANDOM_STATE,
    SafeReader,
    check_pickles,
    load_dcp,
    load_torch_file,
)
from lightning_plugins.cli import main
from lightning_plugins.errors import CheckpointError
from lightning_plugins.strategies.checkpoint_io import ShardedCheckpoints

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "full_tp2.yaml"
# One process, checkpoints every 2 steps; a constant schedule (what is checked here does not depend on it), so each
# door's run is test_resume_changed's and one run serves both (_launch.shared_run): 4 steps through the Lightning door,
# 6 through the Accelerate door (a copy leaves its step=6.ckpt out).
ONE = ["--layout.tp_size=1", "--hardware.devices=1", "--parallel.sequence_parallel=false",
       "--parallel.loss_parallel=false", "--train.micro_batch_size=8", "--train.checkpoint_every=2",
       "--train.log_every=1", "--train.eval_every=100", "--optim.scheduler=constant",
       "--optim.warmup_steps=2"]  # fmt: skip
DOORS = {"lightning": ["-m", "lightning_plugins", "finetune"], "accelerate": ["-m", "lightning_plugins.accelerate"]}
STEPS = {"lightning": 4, "accelerate": 6}
#: What the payload calls: named by the refusal.
CALLED = "shutil.copyfile"
#: torch's advice on a refused file (load it with ``weights_only=False``): never given.
ADVICE = re.compile(r"weights_only=False|weights_only` set to `False`|trust the source", re.IGNORECASE)


class Payload:
    """Unpickled, it writes ``target`` (by calling a function a checkpoint never holds)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple:
        return (shutil.copyfile, (str(RECIPE), str(self.target)))


# ------------------------------------------------------------------------------------------------ planting


def rewrite_checksums(checkpoint: Path) -> None:
    """What whoever planted a file does next: ``checksums.json`` made to match the files as they are now."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        data = (checkpoint / name).read_bytes()
        entry.update(digest=hashlib.sha256(data).hexdigest(), size=len(data))
    (checkpoint / MANIFEST).write_text(json.dumps(manifest, indent=1))


def plant_metadata(checkpoint: Path, marker: Path) -> Path:
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return checkpoint / ".metadata"


def plant_data_entry(checkpoint: Path, marker: Path) -> Path:
    """A non-tensor entry (an optimizer setting) pointed at a payload appended to its data file; ``.metadata`` holds
    only DCP's own classes, so it passes the metadata check and the entry is what is refused."""
    metadata = SafeReader(checkpoint).read_metadata()
    index, info = next(
        (index, info) for index, info in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
    )  # fmt: skip
    data = checkpoint / info.relative_path
    buffer = io.BytesIO()
    torch.save(Payload(marker), buffer)  # as DCP writes an entry
    payload = buffer.getvalue()
    offset = data.stat().st_size
    with open(data, "ab") as stream:
        stream.write(payload)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload), info.transform_descriptors)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    return data


def _torch_file(name: str, key: str, allow: tuple = ()) -> Callable[[Path, Path], Path]:
    """Plant the payload under ``key`` of the ``torch.save`` file ``name``, the rest of it as it was."""

    def plant(checkpoint: Path, marker: Path) -> Path:
        path = checkpoint / name
        state = load_torch_file(path, allow)
        state[key] = Payload(marker)
        torch.save(state, path)
        return path

    return plant


#: Each pickle a checkpoint holds -> (the door whose checkpoints hold it, how to plant a payload in it).
PLANTS: dict[str, tuple[str, Callable[[Path, Path], Path]]] = {
    ".metadata": ("lightning", plant_metadata),
    "data entry": ("accelerate", plant_data_entry),
    "meta.pt": ("lightning", _torch_file("meta.pt", "loops")),
    "rng": ("accelerate", _torch_file(RNG_FILE.format(rank=0), "numpy", NUMPY_RANDOM_STATE)),
    "accelerator state": ("accelerate", _torch_file(STATE_FILE, "custom")),
}


def refused(path: Path) -> str:
    """The refusal's words: the file, that it was not loaded, what it holds."""
    return rf"{re.escape(str(path))} was not loaded: it holds objects a checkpoint never holds \({re.escape(CALLED)}\)"


# ------------------------------------------------------------------------------------------------ fixtures


def _door(door: str, out: Path, *extra: str, expected: int | None = 0):
    command = [*_command(door), f"--train.output_dir={out}", *extra]
    return run_command(command, cwd=ROOT, timeout=300, expected=expected)


def _command(door: str) -> list[str]:
    """The door's run, without its output directory: the same command resumes it."""
    return [sys.executable, *DOORS[door], str(RECIPE), *ONE, f"--train.max_steps={STEPS[door]}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run per door (checkpoints every 2 steps): their output directories, shared with test_resume_changed."""
    return {door: shared_run(tmp_path_factory, _command(door)) for door in DOORS}


def planted(runs: dict[str, Path], tmp_path: Path, what: str) -> tuple[Path, Path, Path]:
    """A copy of the door's output directory (its checkpoints up to step 4) whose ``step=4.ckpt`` holds the payload
    ``what`` under matching checksums: (output directory, the planted file, the marker the payload would write)."""
    door, plant = PLANTS[what]
    out = tmp_path / "out"
    shutil.copytree(runs[door] / "checkpoints", out / "checkpoints", ignore=lambda _, names: {"step=6.ckpt"} & {*names})
    marker = tmp_path / "marker"
    path = plant(out / "checkpoints" / "step=4.ckpt", marker)
    rewrite_checksums(out / "checkpoints" / "step=4.ckpt")
    return out, path, marker


# ------------------------------------------------------------------------------------------------ in one process


@pytest.mark.parametrize("what", PLANTS)
def test_verify_export_auto_resume_and_the_loaders_refuse_it(
    runs: dict[str, Path], tmp_path: Path, what: str, capsys: pytest.CaptureFixture
) -> None:
    out, path, marker = planted(runs, tmp_path, what)
    checkpoint = out / "checkpoints" / "step=4.ckpt"
    said = refused(path)
    for argv in (["verify", str(checkpoint)], ["export", str(checkpoint), str(tmp_path / "hf")]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        message = str(stop.value.code)
        assert stop.value.code not in (0, None) and re.search(said, message), message
        assert not ADVICE.search(message) and "weights_only" not in message, message  # no advice to load it anyway
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    skipped: list[str] = []
    assert latest_checkpoint(out, skipped.append) == out / "checkpoints" / "step=2.ckpt"
    assert len(skipped) == 1 and skipped[0].startswith("Skipping step=4.ckpt for auto-resume: "), skipped
    assert re.search(said, skipped[0]), skipped
    # Both doors' loaders (what --resume runs), in one process: refused before anything is read into a model.
    lightning = types.SimpleNamespace(broadcast=lambda obj: obj, global_rank=0)
    with pytest.raises(CheckpointError, match=said):
        ShardedCheckpoints.load_checkpoint(lightning, checkpoint)
    with pytest.raises(CheckpointError, match=said):
        load_training_state(None, checkpoint)
    assert not marker.exists()
    capsys.readouterr()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_the_safe_readers_refuse_it_without_the_checksum_check(runs: dict[str, Path], tmp_path: Path) -> None:
    """Each reader refuses on its own (the check before a load aside): ``.metadata`` and a data entry through the
    DCP load, the ``torch.save`` files through their loaders; :func:`check_pickles` finds each."""
    for what in PLANTS:
        out, path, marker = planted(runs, tmp_path / what.replace(" ", "_"), what)
        checkpoint = out / "checkpoints" / "step=4.ckpt"
        said = refused(path)
        with pytest.raises(CheckpointError, match=said):
            check_pickles(checkpoint)
        if what == ".metadata":
            with pytest.raises(CheckpointError, match=said):
                load_dcp({}, checkpoint, no_dist=True)
        elif what == "data entry":  # every non-tensor entry asked for, the planted one among them
            entries = SafeReader(checkpoint).read_metadata().state_dict_metadata
            state = {key: 0.0 for key, md in entries.items() if isinstance(md, BytesStorageMetadata)}
            with pytest.raises(CheckpointError, match=said):
                load_dcp(state, checkpoint, no_dist=True)
        elif what == "rng":
            with pytest.raises(CheckpointError, match=said):
                read_rng(checkpoint, 0)
        else:
            with pytest.raises(CheckpointError, match=said):
                load_torch_file(path)
        assert not marker.exists(), what


def test_the_payload_runs_where_torch_reads_it(runs: dict[str, Path], tmp_path: Path) -> None:
    """What the checks stand against (so the tests above can fail): torch's own reader runs a planted ``.metadata``."""
    from torch.distributed.checkpoint import FileSystemReader

    out, _, marker = planted(runs, tmp_path, ".metadata")
    with pytest.raises(Exception):  # noqa: B017 -- after the payload ran, DCP finds no Metadata
        FileSystemReader(out / "checkpoints" / "step=4.ckpt").read_metadata()
    assert marker.is_file()


def test_checkpoints_this_package_writes_pass_every_check(runs: dict[str, Path]) -> None:
    """Both doors' checkpoints load through the safe readers: every pickle in them, each data entry included."""
    for out in runs.values():
        for checkpoint in sorted((out / "checkpoints").glob("step=*.ckpt")):
            check_pickles(checkpoint)
            assert read_rng(checkpoint, 0) is not None
    assert RNG_FILE.format(rank="*") == "rng_state_*.pt"  # the name check_pickles allows NumPy's state in


# ------------------------------------------------------------------------------------------------ the doors


@pytest.mark.parametrize(("door", "what"), [("lightning", ".metadata"), ("accelerate", "accelerator state")])
def test_auto_resume_falls_back_to_the_previous_checkpoint(
    runs: dict[str, Path], tmp_path: Path, door: str, what: str
) -> None:
    """The same command again: the planted ``step=4.ckpt`` is skipped (said once, naming the file), the run resumes
    from step 2 and trains steps 2 to the end."""
    out, path, marker = planted(runs, tmp_path, what)
    proc = _door(door, out)
    said = proc.stdout + proc.stderr
    assert said.count("Skipping step=4.ckpt for auto-resume:") == 1 and re.search(refused(path), said), said[-3000:]
    assert f"resumed_from: {out / 'checkpoints' / 'step=2.ckpt'}" in proc.stdout, said[-3000:]
    assert "Traceback" not in said and not ADVICE.search(said), said[-3000:]
    assert not marker.exists()
    with open(out / "metrics.csv", newline="") as handle:
        steps = [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")]
    assert steps == list(range(2, STEPS[door])), steps


@pytest.mark.parametrize(("door", "what"), [("lightning", "meta.pt"), ("accelerate", "rng")])
def test_resume_stops_naming_the_file(runs: dict[str, Path], tmp_path: Path, door: str, what: str) -> None:
    """``--resume`` of the planted checkpoint: the run stops before training, naming the file, non-zero."""
    out, path, marker = planted(runs, tmp_path, what)
    proc = _door(door, tmp_path / "run", f"--resume={out / 'checkpoints' / 'step=4.ckpt'}", expected=None)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and re.search(refused(path), said), said[-3000:]
    assert not ADVICE.search(said), said[-3000:]  # (the door's traceback shows Lightning's own weights_only argument)
    assert not marker.exists() and not (tmp_path / "run" / "checkpoints").exists()
