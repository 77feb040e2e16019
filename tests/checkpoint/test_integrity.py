"""Checkpoints that prove themselves (issue 23): every file of a checkpoint has a checksum recorded while it was written
(``checksums.json``); a damaged one (4 KiB zeroed inside a weight file, a truncated file, a missing file) is refused by
``lightning-plugins verify``, by export and by resume in both doors, naming the file; auto-resume skips it for the
newest intact checkpoint and the resumed run is on the uninterrupted run's trajectory. A disk that fills up during a
save ends every rank with the path, the bytes needed and free, and leaves the previous checkpoint the latest.

One uninterrupted Lightning run (TP=2, checkpoints at steps 2, 4 and 6) is shared by the tests that need a world (and
with test_kill_resume and test_run_lock, whose run it is too).
"""

from __future__ import annotations

import csv
import errno
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _launch import declare_finetune_run, shared_run
from lightning_plugins.testing.world import free_port, run_command

from lightning_plugins.checkpoint.async_save import AsyncCheckpointer
from lightning_plugins.cli import main
from lightning_plugins.checkpoint.disk_space import check_room, checkpoint_bytes, writing_checkpoint
from lightning_plugins.errors import CheckpointWriteError
from lightning_plugins.checkpoint.export import export_checkpoint
from lightning_plugins.errors import ExportError
from lightning_plugins.checkpoint.integrity import MANIFEST, _HashingStream
from lightning_plugins.checkpoint.resume import publish
from lightning_plugins.checkpoint.resume_choice import latest_checkpoint

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "full_tp2.yaml"
CONFIG = ROOT / "accelerate_configs" / "cpu_2proc.yaml"
DISK_FULL = ROOT / "tests" / "scripts" / "disk_full.py"
STEPS = 6
ARGS = [f"--train.max_steps={STEPS}", "--train.log_every=1", "--train.eval_every=100", "--train.checkpoint_every=2",
        "--optim.warmup_steps=2", "--train.micro_batch_size=8"]  # fmt: skip
# The reference run, made in the session's first chain of 2-rank Lightning runs (_launch.shared_finetune_runs).
declare_finetune_run(
    [str(RECIPE), *ARGS], 2, lambda item: item.path == Path(__file__) and "reference" in item.fixturenames
)


def _finetune(out: Path, *extra: str, expected: int | None = 0):
    command = [sys.executable, "-m", "lightning_plugins", "finetune", str(RECIPE), f"--train.output_dir={out}", *ARGS]
    return run_command([*command, *extra], cwd=ROOT, timeout=300, expected=expected)


def _losses(out: Path) -> list[tuple[int, float]]:
    with open(out / "metrics.csv", newline="") as handle:
        return [(int(row["step"]), float(row["train/loss"])) for row in csv.DictReader(handle) if row.get("train/loss")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of one uninterrupted run: test_kill_resume's TP reference and test_run_lock's first run
    too (``_launch.shared_run``: one run of the command per session; they only read it, or copy it)."""
    return shared_run(tmp_path_factory, [sys.executable, "-m", "lightning_plugins", "finetune", str(RECIPE), *ARGS])


def zero_4k(checkpoint: Path) -> str:
    """Zero 4 KiB in the middle of rank 1's weight file (its size unchanged)."""
    path = checkpoint / "__1_0.distcp"
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(4096)
    path.write_bytes(bytes(data))
    return r"__1_0\.distcp: its sha256 is \w+\.\.\., the manifest records \w+\.\.\. \(same size, other bytes\)"


def truncate(checkpoint: Path) -> str:
    path = checkpoint / "__0_0.distcp"
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size - 1000)
    return rf"__0_0\.distcp: {size - 1000} bytes, the manifest records {size} \(truncated or overwritten\)"


def remove_rng(checkpoint: Path) -> str:
    (checkpoint / "rng_state_1.pt").unlink()
    return r"rng_state_1\.pt: missing \(the manifest records \d+ bytes\)"


DAMAGES = {"zeroed": zero_4k, "truncated": truncate, "missing": remove_rng}


def test_the_manifest_names_every_file_with_its_digest(reference: Path) -> None:
    """Checksums computed from the bytes as they were written match the files on disk, and cover every file."""
    for checkpoint in sorted((reference / "checkpoints").glob("step=*.ckpt")):
        files = json.loads((checkpoint / MANIFEST).read_text())["files"]
        on_disk = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()} - {MANIFEST}
        assert set(files) == on_disk and {".metadata", "__0_0.distcp", "rng_state_1.pt", "meta.pt"} <= on_disk, files
        for name, entry in files.items():
            content = (checkpoint / name).read_bytes()
            assert entry == {"algorithm": "sha256", "digest": hashlib.sha256(content).hexdigest(), "size": len(content)}


@pytest.mark.parametrize("damage", DAMAGES)
def test_verify_and_export_refuse_a_damaged_checkpoint(
    reference: Path, tmp_path: Path, damage: str, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = shutil.copytree(reference / "checkpoints" / f"step={STEPS}.ckpt", tmp_path / "step=6.ckpt")
    main(["verify", str(checkpoint)])
    assert "every file matches its checksum" in capsys.readouterr().out
    what = DAMAGES[damage](checkpoint)
    named = rf"{checkpoint} is damaged, so it is not loaded: {what}"
    with pytest.raises(SystemExit) as stop:
        main(["verify", str(checkpoint)])
    assert stop.value.code != 0
    assert re.search(named, str(stop.value.code)), stop.value.code
    with pytest.raises(ExportError, match=named):
        export_checkpoint(checkpoint, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()


@pytest.mark.slow
def test_a_full_disk_ends_every_rank_and_the_run_resumes_past_a_damaged_checkpoint(
    reference: Path, tmp_path: Path
) -> None:
    """The disk fills up on rank 1 while it writes step 4's weights: every rank ends with the path, the bytes needed
    and free, the partial save is removed and step 2 stays the latest. A damaged step=4.ckpt is then put next to it:
    auto-resume skips it (saying why, once), resumes from step 2 and trains steps 2-5 exactly as the uninterrupted
    run did (Lightning door: every rank verifies the same files in the same order)."""
    out = tmp_path / "run"
    command = [sys.executable, str(DISK_FULL), "1", "4", "lightning", "finetune", str(RECIPE),
               f"--train.output_dir={out}", *ARGS]  # fmt: skip
    full = run_command(command, cwd=ROOT, timeout=300, expected=None)
    assert full.returncode != 0
    needed = rf"It needs about (\d+) bytes \([\d.]+ \w+\) and (\d+) bytes \([\d.]+ \w+\) are free on the file system of"
    final = re.escape(str(out / "checkpoints" / "step=4.ckpt"))
    said = rf"CheckpointWriteError: \[Errno 28\] Cannot write the checkpoint {final}: No space left on device.*{needed}"
    for rank in (0, 1):  # DCP's collectives carried rank 1's failure to rank 0
        assert re.search(rf"\[rank{rank}\]: \S*{said}", full.stderr), full.stderr[-4000:]
    stored = sum(p.stat().st_size for p in (reference / "checkpoints" / "step=4.ckpt").glob("*.distcp"))
    estimate = int(re.search(needed, full.stderr).group(1))
    assert stored * 0.95 <= estimate <= stored * 1.1, (estimate, stored)
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step=2.ckpt"]
    main(["verify", str(checkpoints / "step=2.ckpt")])

    zero_4k(shutil.copytree(reference / "checkpoints" / "step=4.ckpt", checkpoints / "step=4.ckpt"))
    proc = _finetune(out)
    assert "Skipping step=4.ckpt for auto-resume:" in proc.stderr and "__1_0.distcp: its sha256" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert proc.stderr.count("Skipping step=4.ckpt") == 1, proc.stderr[-3000:]  # said once, not by every rank
    assert "warning" not in proc.stderr.lower(), proc.stderr[-3000:]
    assert f"resumed_from: {checkpoints / 'step=2.ckpt'}" in proc.stdout, proc.stdout[-3000:]
    got, want = _losses(out), _losses(reference)
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(STEPS)), (got, want)
    torch.testing.assert_close(
        torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), rtol=1e-5, atol=1e-5, msg=str(got)
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    main(["verify", str(checkpoints / "step=4.ckpt")])  # the resumed run wrote it again, in its place, intact


def test_resume_refuses_a_damaged_checkpoint_through_accelerate(reference: Path, tmp_path: Path) -> None:
    """``--resume`` of a damaged checkpoint ends every rank of the Accelerate door before anything is loaded, with the
    file named (rank 0 verifies; every rank raises what it found). The checkpoint is the Lightning run's: its damage is
    found before anything else about it is looked at."""
    checkpoint = shutil.copytree(reference / "checkpoints" / "step=4.ckpt", tmp_path / "step=4.ckpt")
    what = truncate(checkpoint)
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(CONFIG),
              "--main_process_port", str(free_port()), "-m", "lightning_plugins.accelerate"]  # fmt: skip
    command = [*launch, str(RECIPE), f"--train.output_dir={tmp_path / 'run'}", *ARGS, "--resume", str(checkpoint)]
    proc = run_command(command, cwd=ROOT, timeout=300, expected=None)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\].*{re.escape(str(checkpoint))} is damaged, so it is not loaded: {what}",
                         proc.stderr), proc.stderr[-4000:]  # fmt: skip
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_disk_without_room_refuses_the_save_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check before a save (rank 0; here one process) and a write refused by the file system (permission) give
    the same error, naming the path, the bytes needed and free; nothing is left behind."""
    state = {"model": {"w": torch.zeros(256, 256), "b": torch.zeros(256)}, "step": 3}
    partial = tmp_path / "checkpoints" / "step=4.ckpt.partial"
    needed = checkpoint_bytes(state)
    assert needed == 257 * 256 * 4 + 3 * 1536  # two tensors and a number, each in its own item
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=needed - 1))
    final = re.escape(str(partial).removesuffix(".partial"))
    said = rf"Cannot write the checkpoint {final}: not enough free space\. It needs about {needed}"
    with pytest.raises(CheckpointWriteError, match=rf"{said} bytes .* and {needed - 1} bytes .* are free on the file"):
        check_room(partial, state)
    assert not partial.exists()
    monkeypatch.undo()
    assert check_room(partial, state) == needed
    with pytest.raises(CheckpointWriteError, match=rf"Permission denied \({re.escape(str(partial))}/x\)\. It needs"):
        with writing_checkpoint(partial, needed):
            partial.mkdir(parents=True)
            raise PermissionError(errno.EACCES, "Permission denied", str(partial / "x"))
    assert not partial.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_the_async_saver_records_checksums_and_names_a_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process: a background save's files are checksummed as they are written and published with their
    manifest; a disk that fills up during the next one is named when the saver is waited for, its partial removed."""
    state = {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)}}
    saver = AsyncCheckpointer()
    first, partial = tmp_path / "step=2.ckpt", tmp_path / "step=2.ckpt.partial"
    saver.save(state, partial, lambda: publish(partial, first), needed=checkpoint_bytes(state))
    saver.wait()
    main(["verify", str(first)])
    assert {".metadata", "__0_0.distcp"} <= set(json.loads((first / MANIFEST).read_text())["files"])

    def full_disk(self: object, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_HashingStream, "write", full_disk)
    second = tmp_path / "step=4.ckpt.partial"
    saver.save(state, second, lambda: publish(second, tmp_path / "step=4.ckpt"), needed=12345)
    full = r"step=4\.ckpt: No space left on device .* It needs about 12345 bytes"
    with pytest.raises(CheckpointWriteError, match=full):
        saver.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt"]


def test_a_checkpoint_without_checksums_loads_as_before_after_one_line(
    reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A checkpoint written before checksums were recorded: auto-resume picks it and says so once, export reads it;
    ``verify`` has nothing to check it against and says so (exit 1)."""
    checkpoint = shutil.copytree(reference / "checkpoints" / "step=2.ckpt", tmp_path / "checkpoints" / "step=2.ckpt")
    (checkpoint / MANIFEST).unlink()
    said: list[str] = []
    assert latest_checkpoint(tmp_path, said.append) == latest_checkpoint(tmp_path, said.append) == checkpoint
    note = f"{checkpoint} has no {MANIFEST} (written by an older version): loading it without verifying its files."
    assert said == [note]
    export_checkpoint(checkpoint, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file() and "checksums.json" not in capsys.readouterr().err  # said once
    with pytest.raises(SystemExit, match=r"has no checksums\.json .*: nothing to verify it against"):
        main(["verify", str(checkpoint)])
