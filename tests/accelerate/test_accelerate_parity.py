"""A plain Accelerate loop run by ``ParallelAccelerator`` on gloo ranks matches the same loop in one process.

The loop is the one Accelerate users write: ``prepare``, ``accumulate`` (2 micro-batches), ``backward``,
``clip_grad_norm_`` (every micro-batch, as in the issue's loop; clipping triggers), optimizer and
scheduler step. fp32, SGD with momentum, a decaying learning rate (a scheduler stepped the wrong number of
times shows), rows of different valid lengths with ``-100`` labels. The reference is the same function run
by a plain ``accelerate.Accelerator`` in the test process; each launched world checks several layouts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning_plugins.testing.world import run_world
from _accelerate_loop import ACCUM, BATCH, LR, MAX_NORM, ROWS, build, prepared, run_loop
from _counted import counted_settings_checks
from tiny_models import tiny_model

from lightning_plugins.parallel.moe.experts_balance import ExpertBalance
from torch.distributed.tensor import DTensor

TOL = 1e-5


def loop(accelerator: Any, model: torch.nn.Module, shuffle: bool = False, save_at: tuple[int, str] | None = None,
         export_to: str | None = None) -> dict[str, Any]:  # fmt: skip
    """The user's loop. Returns per-micro-batch losses, norms, learning rates, gathered indices, final weights."""
    model, optimizer, loader, scheduler = prepared(accelerator, model, shuffle)
    out = run_loop(accelerator, model, optimizer, loader, scheduler, save_at)
    out["weights"] = {name: _full(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
    if export_to is not None:
        accelerator.save_model(model, export_to)
    return out


def resume(accelerator: Any, model: torch.nn.Module, path: str) -> dict[str, Any]:
    """A new process: prepare the same objects, load the state, run the rest of the epoch."""
    model, optimizer, loader, scheduler = prepared(accelerator, model, shuffle=True)
    accelerator.load_state(path)
    return run_loop(accelerator, model, optimizer, loader, scheduler)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def reference(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each case's loop in this process through a plain ``accelerate.Accelerator``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    results = {}
    try:
        for name, case in cases.items():
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, dataloader_config=_loading(case))
            model = build(case)
            balance = ExpertBalance.of(model)
            results[name] = loop(accelerator, model)
            if balance is not None:  # the routing of the whole run, as one process counts it
                results[name]["moe"] = balance.read(reduce=False), balance.last_counts
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return results


def _loading(case: dict[str, Any]) -> Any:
    """Data-parallel cases split each loader batch over the ranks, so the global batch is the one process's."""
    from accelerate import DataLoaderConfiguration

    return DataLoaderConfiguration(split_batches=case.get("split", False))


def _check(name: str, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    assert max(want["norm"]) > MAX_NORM, f"{name}: the test must exercise clipping ({max(want['norm'])})"
    for key in ("loss", "norm", "lr"):
        values = torch.tensor(got[key]), torch.tensor(want[key])
        torch.testing.assert_close(
            *values, rtol=TOL, atol=TOL, msg=lambda m: f"{name} {key}: {m} got {got[key]} want {want[key]}"
        )
    assert got["index"] == list(range(ROWS)), f"{name}: gather_for_metrics saw {got['index']}"
    for param_name, weight in got["weights"].items():
        torch.testing.assert_close(weight, want["weights"][param_name], rtol=TOL, atol=TOL, msg=f"{name} {param_name}")
    return list(got["weights"])


def _check_export(name: str, case: dict[str, Any], path: str, want: dict[str, Any]) -> None:
    """``save_model`` wrote what plain transformers (or peft) loads: the trained weights."""
    from transformers import AutoModelForCausalLM

    if case.get("lora"):
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(tiny_model("llama"), path)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(path)
    params = dict(loaded.named_parameters())
    assert set(params) == set(want["weights"]), f"{name} export: {sorted(set(params) ^ set(want['weights']))[:4]}"
    for param_name, weight in want["weights"].items():
        torch.testing.assert_close(params[param_name].detach(), weight, rtol=TOL, atol=TOL, msg=f"{name} export")


def _run_cases(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], expected: dict[str, dict[str, Any]], root: str
) -> None:
    import torch.distributed as dist

    from lightning_plugins.accelerate import ParallelAccelerator
    from lightning_plugins.errors import LayoutError

    for name, case in cases.items():
        sizes = {k: case[k] for k in ("tp_size", "pp_size", "cp_size", "dp_shard_size", "ep_size") if k in case}
        settings = {**sizes, **case.get("settings", {}), "dataloader_config": _loading(case)}
        accelerator = ParallelAccelerator(**settings, cpu=True, gradient_accumulation_steps=ACCUM)
        export = f"{root}/{name}" if case.get("export") else None
        with counted_settings_checks() as checks:  # the plan resolved by the constructor: prepare checks the config
            got = loop(accelerator, build(case), export_to=export)
        assert [check for check, _ in checks] == ["check_model_fit"] and checks[0][1] is not None, (name, checks)
        if "moe" in expected[name]:  # the routing balance over every rank: one process's counts, exactly
            figures, counts = expected[name]["moe"]
            assert accelerator.moe_balance() == pytest.approx(figures, rel=TOL, abs=0), name
            assert torch.equal(accelerator.balance.last_counts, counts), (name, accelerator.balance.last_counts, counts)
        seen = [None] * world_size
        dist.all_gather_object(seen, _check(name, got, expected[name]))
        assert set().union(*seen) == set(expected[name]["weights"]), f"{name}: some parameters are on no rank"
        if export and rank == 0:
            _check_export(name, case, export, expected[name])
    # An optimizer built on the parameters that preparing the model replaced would train nothing: refused.
    # (The last case's model: its layout may need its layers, e.g. 2 stages per rank.)
    model = build(case)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    accelerator.prepare(model)
    with pytest.raises(LayoutError, match="holds .* parameters that preparing the model replaced"):
        accelerator.prepare(optimizer)


TWO_RANKS = {
    "tp2": {"tp_size": 2, "export": True},
    "tp2_plain": {"tp_size": 2, "settings": {"sequence_parallel": False, "loss_parallel": False}},
    "pp2": {"pp_size": 2, "settings": {"pp_schedule": "1f1b", "pp_microbatches": 2}, "export": True},
    "cp2_ulysses": {"cp_size": 2, "settings": {"cp_backend": "ulysses"}},
    "cp2_ring": {"cp_size": 2, "settings": {"cp_backend": "ring"}},
    "fsdp2": {"dp_shard_size": 2, "split": True},
    "mixtral_ep2": {"family": "mixtral", "ep_size": 2, "split": True},
    "qwen2_moe_tp2": {"family": "qwen2_moe", "tp_size": 2},  # each TP rank routes its share of the tokens
    # Each stage routes its own layers' tokens: the counts summed over the world are one process's, layer by layer.
    "mixtral_pp2": {"family": "mixtral", "pp_size": 2, "settings": {"pp_schedule": "1f1b", "pp_microbatches": 2}},
    "lora_tp2": {"tp_size": 2, "lora": True, "export": True},
    # Issue 27's families: Gemma 3's alternating local (window 8) and global layers over the ring, Granite's
    # multipliers and logit scaling with sequence and loss parallel (a fallback family: its plan read from structure).
    "gemma3_cp2_ring": {"family": "gemma3", "cp_size": 2, "settings": {"cp_backend": "ring"}},
    "granite_tp2": {"family": "granite", "tp_size": 2},
    # A tied embedding: the first stage's optimizer holds it under the embedding's name, the last stage's under the
    # head's; both copies take the same update (they drifted apart after the first step when the first lost it).
    "tied_pp2": {"family": "llama_tied_4l", "pp_size": 2, "settings": {"pp_schedule": "1f1b", "pp_microbatches": 2}},
    "gemma3_pp2": {"family": "gemma3", "pp_size": 2, "settings": {"pp_schedule": "1f1b", "pp_microbatches": 2}},
}
FOUR_RANKS = {
    "tp2_fsdp2": {"tp_size": 2, "dp_shard_size": 2, "split": True},
    "pp2_tp2": {"pp_size": 2, "tp_size": 2, "settings": {"pp_microbatches": 2}},
    "pp2_cp2_ulysses": {"pp_size": 2, "cp_size": 2, "settings": {"pp_microbatches": 2, "cp_backend": "ulysses"}},
    # Stages of a family beyond the registered ones (OLMo 2: post-norms, q/k norms over all heads), FSDP2.
    "olmo2_pp2_fsdp2": {
        "family": "olmo2", "pp_size": 2, "split": True,
        "settings": {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2},
    },
}


def test_two_ranks_match_one_process(tmp_path) -> None:
    run_world(_run_cases, 2, TWO_RANKS, reference(TWO_RANKS), str(tmp_path))


def test_four_ranks_match_one_process(tmp_path) -> None:
    run_world(_run_cases, 4, FOUR_RANKS, reference(FOUR_RANKS), str(tmp_path))


def test_scheduler_steps_once_per_data_parallel_replica() -> None:
    """Without split_batches every data rank reads its own batch: the schedule advances once per replica
    (Accelerate counts processes, which under TP/CP/PP read the same samples; the worlds above check those)."""
    from accelerate.state import GradientState

    from lightning_plugins.accelerate.loaders import DataParallelScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    optimizer.step_was_skipped = False  # what AcceleratedOptimizer reports after a real step
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    optimizer.step()
    try:
        DataParallelScheduler(schedule, optimizer, replicas=3).step()
        assert schedule.last_epoch == 3 and optimizer.param_groups[0]["lr"] == 0.25
        DataParallelScheduler(schedule, optimizer, replicas=3, split_batches=True).step()
        assert schedule.last_epoch == 4  # a split batch is one global batch
    finally:
        GradientState._reset_state()


def _save_then_continue(rank: int, world_size: int, case: dict[str, Any], root: str) -> None:
    from lightning_plugins.accelerate import ParallelAccelerator

    torch.manual_seed(5)
    accelerator = ParallelAccelerator(**case, cpu=True, gradient_accumulation_steps=ACCUM)
    full = loop(accelerator, build({}), shuffle=True, save_at=(3, f"{root}/state"))
    torch.save({k: full[k] for k in ("loss", "norm", "lr", "index")}, f"{root}/full_{rank}.pt")


def _load_and_continue(rank: int, world_size: int, case: dict[str, Any], root: str) -> None:
    from lightning_plugins.accelerate import ParallelAccelerator

    torch.manual_seed(123)  # another seed: every random state that matters comes from the checkpoint
    accelerator = ParallelAccelerator(**case, cpu=True, gradient_accumulation_steps=ACCUM)
    rest = resume(accelerator, build({}), f"{root}/state")
    full = torch.load(f"{root}/full_{rank}.pt")
    # Saved after micro-batch 3, in the middle of an accumulation window: the rest continues it.
    for key in ("loss", "norm", "lr"):
        torch.testing.assert_close(torch.tensor(rest[key]), torch.tensor(full[key][3:]), rtol=0, atol=1e-6, msg=key)
    assert rest["index"] == full["index"][3 * BATCH :] and sorted(full["index"]) == list(range(ROWS))


@pytest.mark.parametrize("case", [{"tp_size": 2}, {"pp_size": 2, "pp_microbatches": 2}], ids=["tp2", "pp2"])
def test_save_state_then_load_state_in_new_processes_continues(tmp_path, case: dict[str, Any]) -> None:
    run_world(_save_then_continue, 2, case, str(tmp_path))
    assert (tmp_path / "state" / ".metadata").is_file() and not (tmp_path / "state.partial").exists()
    run_world(_load_and_continue, 2, case, str(tmp_path))
