"""``train.loggers`` and ``output_dir/run.json`` through both doors: one 2-rank TP run per door with every logger (a
full fine-tune through Lightning, LoRA merged through Accelerate; wandb offline, MLflow's file store, no network
reached), each logger's files read back with its own reader, the same metric names through both doors, the resolved
recipe as the hyperparameters, and the run manifest checked against the recipe, the installed versions, the data
files' hashes and the world."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning_plugins.testing.world import free_port, run_command

from lightning_plugins.recipe.manifest import PACKAGES, attach_manifest, write_manifest
from lightning_plugins.recipe.preflight import check_here
from lightning_plugins.recipe.schema import Recipe, load_recipe
from lightning_plugins.errors import RecipeError
from lightning_plugins.recipe.record import hyperparameters, mlflow_tracking_uri, wandb_offline

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "full_tp2.yaml"
OVERRIDES = ["--train.max_steps=3", "--train.log_every=1", "--train.eval_every=2",
             "--train.loggers=[csv, tensorboard, wandb, mlflow]"]  # fmt: skip
# Per door: the recipe, its own settings (the wandb project and MLflow experiment: the default, the directory's name,
# or set) and the directories it exports, each of which carries run.json.
RUNS = {
    "lightning": (RECIPE, [], ["hf"]),
    "accelerate": (RECIPE.with_name("lora_tp2.yaml"), ["--train.project=tiny-run", "--train.merge_lora=true"],
                   ["adapter", "merged"]),
}  # fmt: skip
METRICS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss", "epoch"} | {
    "perf/step_s", "perf/own_s", "perf/data_wait_s", "perf/slowest_rank", "perf/slowest_ratio"
}  # fmt: skip


class _Listener:
    """A local port standing in for every network endpoint (wandb's server, HTTP(S) proxies): what reached it."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.requests: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                self.requests.append(conn.recv(200))  # e.g. b'CONNECT host:443 HTTP/1.1 ...'
            except OSError:
                self.requests.append(b"")
            conn.close()


def _run(door: str, out: Path, network: _Listener) -> subprocess.CompletedProcess:
    recipe, extra, _ = RUNS[door]
    args = [str(recipe), f"--train.output_dir={out}", *OVERRIDES, *extra]
    if door == "lightning":
        command = [sys.executable, "-m", "lightning_plugins", "finetune", *args]
    else:
        accelerate = str(Path(sys.executable).parent / "accelerate")
        command = [accelerate, "launch", "--config_file", str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"),
                   "--main_process_port", str(free_port()), "-m", "lightning_plugins.accelerate", *args]  # fmt: skip
    offline = {"WANDB_MODE": "offline", "WANDB_BASE_URL": network.url, "MLFLOW_TRACKING_URI": "",
               "MLFLOW_DISABLE_TELEMETRY": "true",  # MLflow's usage telemetry (on by default) is the user's to allow
               "HF_UPDATE_DOWNLOAD_COUNTS": "false"}  # so is `datasets`' count of its json builder's use  # fmt: skip
    proxies = {name: network.url for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    proc = run_command(command, cwd=ROOT, timeout=300, **offline, **proxies, NO_PROXY="", no_proxy="")
    assert "warning" not in proc.stderr.lower(), proc.stderr[-3000:]  # a clean console
    return proc


def _recipe(out: Path, door: str) -> Recipe:
    recipe, extra, _ = RUNS[door]
    return load_recipe(recipe, [f"--train.output_dir={out}", *OVERRIDES, *extra])


def _scalar(value: Any) -> Any:
    """A hyperparameter as TensorBoard's hparams keep it (numbers as floats)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _tensorboard(out: Path) -> tuple[set[str], dict[str, Any]]:
    """The scalar tags of every event file under ``out/tensorboard``, and the hyperparameters: from the events'
    hparams plugin (Accelerate's habit) or ``hparams.yaml`` (Lightning's, without an ``hp_metric``)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    tags: set[str] = set()
    hparams: dict[str, Any] = {}
    for path in (out / "tensorboard").rglob("events.out.tfevents.*"):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                plugin = value.metadata.plugin_data
                if plugin.plugin_name != "hparams":
                    tags.add(value.tag)
                    continue
                data = plugin_data_pb2.HParamsPluginData.FromString(plugin.content)
                for key, item in data.session_start_info.hparams.items():
                    hparams[key] = getattr(item, item.WhichOneof("kind"))
    for path in (out / "tensorboard").rglob("hparams.y*ml"):
        hparams.update({key: _scalar(value) for key, value in yaml.safe_load(path.read_text()).items()})
    return tags, hparams


def _mlflow(out: Path, project: str) -> tuple[set[str], dict[str, str]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    assert run.info.run_name == "version_0"
    return set(run.data.metrics), run.data.params


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file, decoded with wandb's own ``Record`` protobuf. wandb 0.31 no longer ships
    a Python reader of its datastore (its ``wandb-core`` writes it): its framing is LevelDB's log format (32 KiB
    blocks of records with 7-byte headers: crc32c, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def _wandb(out: Path) -> tuple[set[str], dict[str, Any], str]:
    [path] = (out / "wandb").glob("offline-run-*/run-*.wandb")
    names: set[str] = set()
    config: dict[str, Any] = {}
    run_name = ""
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_name = f"{record.run.project}/{record.run.display_name}"
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            names |= {item.key or "/".join(item.nested_key) for item in record.history.item}
    hidden = {name for name in names | set(config) if name.startswith("_")}
    return names - hidden, {k: v for k, v in config.items() if k not in hidden}, run_name


def _git_commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def _check_manifest(out: Path, recipe: Recipe, door: str) -> None:
    [attempt] = json.loads((out / "run.json").read_text())["attempts"]
    assert attempt["recipe"] == json.loads(recipe.model_dump_json())
    assert attempt["versions"] == {name: metadata.version(name) for name in PACKAGES}
    assert attempt["world_size"] == 2 and attempt["hosts"] == [socket.gethostname()] * 2
    for key in ("train", "eval"):
        source = Path(getattr(recipe.data, key))
        assert attempt["data"][key] == {"path": str(source), "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    assert str(RUNS[door][0]) in attempt["command"]
    if door == "accelerate":  # the worker's command, and the launcher's
        assert set(OVERRIDES) <= set(attempt["command"]) and "launch" in attempt["launcher"]
    else:  # rank 0 is the launching process
        assert set(OVERRIDES) <= set(attempt["command"]) and attempt["launcher"] is None
    if (ROOT / ".git").exists():
        assert attempt["git"]["commit"] == _git_commit() and isinstance(attempt["git"]["dirty"], bool)
    for exported in RUNS[door][2]:  # every export carries it
        assert (out / exported / "run.json").read_text() == (out / "run.json").read_text(), exported


@pytest.mark.parametrize("door", ["lightning", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_loggers_and_manifest(tmp_path: Path, door: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the run's file store back, as the run wrote it
    network = _Listener()
    out = tmp_path / door
    _run(door, out, network)
    recipe = _recipe(out, door)
    project = "tiny-run" if RUNS[door][1] else door
    want = hyperparameters(recipe)
    assert want["optim.lr"] == recipe.optim.lr and want["layout.tp_size"] == 2
    assert want["data.train"] == recipe.data.train and ("lora.r" in want) == (recipe.lora is not None)

    with open(out / "logs" / "version_0" / "metrics.csv", newline="") as handle:
        csv_names = set(handle.readline().strip().split(",")) - {"step"}
    assert yaml.safe_load((out / "logs" / "version_0" / "hparams.yaml").read_text()) == want
    tb_names, tb_hparams = _tensorboard(out)
    assert tb_hparams == {key: _scalar(value) for key, value in want.items()}
    mlflow_names, mlflow_params = _mlflow(out, project)
    assert mlflow_params == {key: str(value) for key, value in want.items()}
    wandb_names, wandb_config, wandb_run = _wandb(out)
    assert wandb_config == want and wandb_run == f"{project}/version_0"
    # Lightning's WandbLogger adds its own step; every other name is the same through both doors.
    wandb_names.discard("trainer/global_step")
    for names in (csv_names, tb_names, mlflow_names, wandb_names):
        assert names == METRICS, names
    assert not network.requests, network.requests  # nothing reached for the network
    _check_manifest(out, recipe, door)


def test_logger_settings_and_attempts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RecipeError, match="unknown logger 'tensorbord': did you mean tensorboard"):
        load_recipe(RECIPE, ["--train.loggers=[csv, tensorbord]"])
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    train = load_recipe(RECIPE, ["--train.wandb_offline=true"]).train
    assert wandb_offline(train) and not wandb_offline(load_recipe(RECIPE).train)
    assert mlflow_tracking_uri(train) == "http://mlflow.example:5000"  # MLflow's own setting wins
    find_spec = importlib.util.find_spec  # a machine without wandb: refused before anything starts, naming the fix
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    wanted = load_recipe(RECIPE, [f"--train.output_dir={tmp_path / 'w'}", "--train.loggers=[csv, wandb]"])
    with pytest.raises(RecipeError, match=r"wandb, whose package wandb is not installed here: .*pip install wandb"):
        check_here(wanted, RECIPE)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    recipe = load_recipe(RECIPE, [f"--train.output_dir={tmp_path}", "--data.eval=trl-lib/tldr:validation"])
    first = json.loads(write_manifest(recipe).read_text())["attempts"]  # no process group: one host
    later = json.loads(write_manifest(recipe).read_text())["attempts"]  # a resumed attempt keeps the earlier one
    assert len(first) == 1 and later[0] == first[0] and len(later) == 2
    assert later[1]["world_size"] == 1 and later[1]["data"]["eval"] == {"hub": "trl-lib/tldr:validation"}
    (tmp_path / "hf").mkdir()
    attach_manifest(tmp_path, [tmp_path / "hf"])
    assert json.loads((tmp_path / "hf" / "run.json").read_text())["attempts"] == later
