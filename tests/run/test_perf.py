"""The profiler summary (``train.profile``) and the straggler/data-stall figures (``train.perf_sample``), both doors.

One 2-rank TP world per door, with one rank made slow on purpose by ``tests/scripts/slow_run.py`` (it sleeps before
every training forward: a straggler) and the other's loader slowed (its collator sleeps: a data stall). Collectives
synchronise the ranks, so both ranks' step times are the same; the figures must still name the straggler by its own
time (the step less its exposed communication), by about the margin the sleeps imply, and show the stall as the
other rank's data wait. The profile's totals are checked against the rank's own Chrome trace (the same events, read
independently), the partition of the window (shares sum to 1) and its per-collective sums.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from lightning_plugins.testing.world import free_port, run_command

from lightning_plugins.run.perf import PerfMonitor, ProfileOptions
from lightning_plugins.run.profile_summary import WINDOW, Event, classify, collective_name, summarize
from lightning_plugins.recipe.schema import load_recipe
from lightning_plugins.errors import RecipeError

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "recipes" / "tiny" / "full_tp2.yaml"
SLOW = ROOT / "tests" / "scripts" / "slow_run.py"
CONFIG = ROOT / "accelerate_configs" / "cpu_2proc.yaml"
STRAGGLE_S, STALL_S = 0.5, 0.2  # the straggler's sleep per forward, the stalled loader's per batch (1 per step)
ARGS = ["--train.max_steps=4", "--train.log_every=2", "--train.eval_every=100", "--train.checkpoint_every=null",
        "--train.profile={start_step: 2, steps: 1}", "--train.straggler_ratio=1.1"]  # fmt: skip
PERF = {"perf/step_s", "perf/own_s", "perf/data_wait_s", "perf/slowest_rank", "perf/slowest_ratio"}


def _event(name: str, thread: int, start: int, end: int, device: str = "CPU", annotation: bool = False) -> Event:
    return Event(name, thread, device == "CUDA", start * 1000, end * 1000, annotation)  # microseconds to ns


def test_intervals_partition_the_window_on_cpu_and_gpu_events() -> None:
    """Hand-made timelines (microseconds): the definitions, exactly, for gloo (CPU) and NCCL (GPU kernel) events."""
    cpu = [
        _event(WINDOW, 1, 0, 1000, annotation=True),
        _event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1, 0, 100, annotation=True),
        _event("aten::cat", 1, 10, 90),  # collation: data wait, not compute
        _event("aten::add", 1, 100, 500),  # a DTensor op holding a wait for its peers
        _event("_c10d_functional::wait_tensor", 1, 300, 450),
        _event("gloo:all_reduce", 7, 250, 450, annotation=True),  # 250..300 overlapped by compute
        _event("gloo:all_gather", 8, 600, 700, annotation=True),  # nothing overlaps: exposed
        _event("Optimizer.step#AdamW.step", 1, 700, 900, annotation=True),  # an annotation is no compute
        _event("aten::mul", 1, 750, 800),
        _event("aten::mul", 9, 0, 1000),  # another host thread: not the main one
    ]
    s = summarize(0, *classify(cpu))
    assert (s.window_s, s.data_wait_s) == (1000e-6, 100e-6)
    assert s.compute_s == pytest.approx((250 + 50) * 1e-6)  # 100..300, 450..500, 750..800
    assert s.comm_s == pytest.approx(300e-6) and s.exposed_comm_s == pytest.approx(250e-6)
    assert s.comm_by_op == pytest.approx({"all_gather": 100e-6, "all_reduce": 200e-6})
    assert s.idle_s == pytest.approx(1000e-6 - 300e-6 - 100e-6 - 250e-6)
    assert sum(s.shares().values()) == pytest.approx(1.0, abs=1e-12)
    gpu = [
        _event(WINDOW, 1, 0, 1000, annotation=True),
        _event("aten::mm", 1, 0, 1000),  # host launches: with kernels recorded, only kernels are compute
        _event("sm90_xmma_gemm", 0, 100, 400, device="CUDA"),
        _event("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 0, 300, 600, device="CUDA"),
        _event("ncclDevKernel_SendRecv", 0, 800, 900, device="CUDA"),
    ]
    g = summarize(1, *classify(gpu))
    assert g.compute_s == pytest.approx(300e-6) and g.exposed_comm_s == pytest.approx(300e-6)
    assert g.comm_by_op == pytest.approx({"reduce_scatter": 300e-6, "send/recv": 100e-6})
    assert g.idle_s == pytest.approx(400e-6)
    assert [collective_name(n) for n in ("gloo:all_to_all", "gloo:broadcast", "ncclDevKernel_AllGather_RING_LL")] == [
        "all_to_all", "broadcast", "all_gather"]  # fmt: skip


def test_bad_profile_windows_are_named() -> None:
    for value, key in (("{start_step: 0, steps: 1}", "start_step"), ("{start_step: 2, steps: 0}", "steps")):
        with pytest.raises(RecipeError, match=rf"train\.profile\.{key}=0 must be an integer >= 1"):
            load_recipe(RECIPE, [f"train.profile={value}"])
    with pytest.raises(RecipeError, match=r"optimizer steps 3\.\.5, past the run's last step 4.*start_step: 2"):
        load_recipe(RECIPE, ["train.max_steps=4", "train.profile={start_step: 3, steps: 3}"])
    # With epochs the run's length is known only when it starts: the door checks it then, before any step.
    with pytest.raises(ValueError, match=r"optimizer steps 9\.\.9, past the run's last step 8"):
        PerfMonitor(".", 1, ProfileOptions(9, 1)).begin(0, 8)


def _command(door: str, out: Path) -> list[str]:
    args = [str(RECIPE), f"--train.output_dir={out}", *ARGS]
    if door == "finetune":
        return [sys.executable, str(SLOW), "finetune", *args]
    launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(CONFIG),
              "--main_process_port", str(free_port())]  # fmt: skip
    return [*launch, str(SLOW), "accelerate", *args]


def _trace_totals(trace: Path) -> tuple[float, dict[str, float]]:
    """The window and each collective's summed durations (seconds) as the rank's Chrome trace records them."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    by_op: dict[str, float] = defaultdict(float)
    for event in events:
        if event["name"].startswith("gloo:"):
            by_op[collective_name(event["name"])] += event["dur"] / 1e6
    return next(e["dur"] for e in events if e["name"] == WINDOW) / 1e6, dict(by_op)


@pytest.mark.parametrize(
    ("door", "slow", "stalled"), [pytest.param("finetune", 1, 0, marks=pytest.mark.slow), ("accelerate", 0, 1)]
)
def test_profile_names_the_straggler_and_the_data_stall(tmp_path: Path, door: str, slow: int, stalled: int) -> None:
    out = tmp_path / "out"
    spec = f"forward:{slow}:{STRAGGLE_S},data:{stalled}:{STALL_S}"
    proc = run_command(_command(door, out), cwd=ROOT, timeout=300, LIGHTNING_PLUGINS_TEST_SLOW=spec)
    console = proc.stdout + proc.stderr
    assert "profiler_start" not in console and "profiler_stop" not in console, console[-3000:]

    # The profile of step 2: every rank's trace and summary; totals as the traces record them.
    summary = json.loads((out / "profile" / "summary.json").read_text())
    assert summary["steps"] == [2, 2] and [r["rank"] for r in summary["ranks"]] == [0, 1]
    assert "profile of optimizer steps 2..2" in console and "exposed comm" in console
    for rank in summary["ranks"]:
        window, by_op = _trace_totals(out / "profile" / f"rank{rank['rank']}.json")
        assert rank["window_s"] == pytest.approx(window, rel=1e-6)
        assert rank["comm_by_op"] == pytest.approx(by_op, rel=1e-6) and "all_reduce" in by_op  # TP's all-reduces
        parts = rank["compute_s"] + rank["exposed_comm_s"] + rank["data_wait_s"] + rank["idle_s"]
        assert parts == pytest.approx(rank["window_s"], rel=1e-9)
        assert sum(rank["shares"].values()) == pytest.approx(1.0, abs=1e-9)
        assert rank["exposed_comm_s"] <= rank["comm_s"] <= sum(by_op.values()) + 1e-9
    ranks = summary["ranks"]
    # The straggler's peer waited for it in communication; the stalled rank waited for its loader.
    net = STRAGGLE_S - STALL_S
    assert ranks[stalled]["exposed_comm_s"] > net * 0.8, ranks
    assert STALL_S <= ranks[stalled]["data_wait_s"] < STALL_S + 0.1 and ranks[slow]["data_wait_s"] < 0.05, ranks

    # The sampled log step (4; step 2 was the profile's): the straggler named, by what the sleeps imply.
    (record,) = [json.loads(line) for line in (out / "ranks.jsonl").read_text().splitlines()]
    own = [r["own_s"] for r in record["ranks"]]
    assert record["step"] == 4 and record["slowest_rank"] == slow, record
    assert own[slow] - own[stalled] == pytest.approx(net, abs=0.1), record
    assert record["slowest_ratio"] == pytest.approx(own[slow] / statistics.median(own), rel=1e-9)
    implied = (own[stalled] + net) / statistics.median([own[stalled], own[stalled] + net])
    assert record["slowest_ratio"] == pytest.approx(implied, abs=0.1) and record["slowest_ratio"] > 1.1, record
    stalls = [r["data_wait_s"] for r in record["ranks"]]
    assert STALL_S <= stalls[stalled] < STALL_S + 0.1 and stalls[slow] < 0.05, record
    assert f"step 4: rank {slow} is the slowest: {record['slowest_ratio']:.2f}x the median own time" in console

    # The same metric names through both doors, logged with the log step's others.
    with open(out / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("perf/slowest_rank")]
    assert [(row["step"], float(row["perf/slowest_rank"])) for row in rows] == [("3", float(slow))], rows
    assert PERF <= set(rows[0]) and float(rows[0]["perf/data_wait_s"]) >= STALL_S
