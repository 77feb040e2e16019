"""Preference losses under pipeline parallelism train exactly as one process: DPO with LoRA under 1F1B and interleaved
1F1B (default), and under GPipe, with FSDP2, tensor parallelism (sequence parallel, loss parallel), ring context
parallelism, ORPO / SimPO's NLL terms, a full fine-tune's DPO against a frozen copy of its starting checkpoint
split into the same stages and shards, and KTO (its KL rows in forward-only passes of their own; slow, 4 ranks).

fp32, gloo, a 4-layer tiny Llama. Each training batch holds PAIRS chosen rows then their PAIRS rejected rows; the
pipeline path (:mod:`lightning_plugins.preference.pipeline`) puts the two rows of a pair in one pipeline micro-batch,
computes the reference's log-probabilities (adapters disabled) through the forward-only schedule and the policy's
loss per micro-batch on the last stage. SGD with momentum, two batches accumulated (the pipeline's ``loss_scale``),
clipping that triggers over all stages, random non-zero ``lora_B``. Compared with one process (a plain peft model,
full logits): per-step losses and pre-clip gradient norms, TRL's metrics of every batch, an evaluation batch whose
pairs do not split into the micro-batches (padded), and every rank's adapters, to 1e-5.

The default cases (2 ranks) run inside the 2-rank world of ``tests/parallel/test_pipeline_parity.py``
(:func:`check_in_rank`), so they start no world of their own; the 4-rank matrix (slow) launches one here.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import world_json
from tiny_models import make_batch, tiny_model
from torch.distributed.tensor import DTensor

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.parallel import clip_grad_norm_, context_parallel_batch
from lightning_plugins.parallel.options import with_settings
from lightning_plugins.preference import KTOObjective, PreferenceObjective, PreferenceOptions
from lightning_plugins.preference.pipeline import find_pipeline

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS, ACCUM, PAIRS, EVAL_PAIRS, SEQ, MAX_NORM, LR, TOL = 3, 2, 4, 3, 16, 0.05, 1.0, 1e-5
DPO = PreferenceOptions(method="dpo", beta=0.5)
OBJECTIVES = {
    "dpo": DPO,
    "orpo": PreferenceOptions(method="orpo", beta=0.5),
    "simpo": PreferenceOptions(method="simpo", beta=2.0, simpo_gamma=0.3, sft_weight=0.7),
    "kto": PreferenceOptions(method="kto", beta=0.5, desirable_weight=1.3, undesirable_weight=0.7),
}
PP2 = {"pp_size": 2}
ONE_F_ONE_B = {"pp_schedule": "1f1b", "pp_microbatches": 2}
INTERLEAVED = {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 4}  # one pair a micro-batch
GPIPE, RING = {"pp_schedule": "gpipe", "pp_microbatches": 2}, {"cp_backend": "ring"}
# world size -> name -> (objective, layout sizes, parallel/memory settings)
CASES = {
    2: {
        "pp2 1f1b chunked": ("dpo", PP2, {**ONE_F_ONE_B, "loss_chunk_tokens": 7}),
        "pp2 interleaved logits": ("dpo", PP2, {**INTERLEAVED, "loss_chunk_tokens": None}),
    },
    4: {
        "pp2 x fsdp2 gpipe chunked": ("dpo", {**PP2, "dp_shard_size": 2}, {**GPIPE, "loss_chunk_tokens": 7}),
        "pp2 x tp2 sp+lp 1f1b logits": ("dpo", {**PP2, "tp_size": 2}, {**ONE_F_ONE_B, "loss_chunk_tokens": None}),
        "pp2 x tp2 sp+lp interleaved chunked": ("dpo", {**PP2, "tp_size": 2}, {**INTERLEAVED, "loss_chunk_tokens": 7}),
        "pp2 x cp2 ring 1f1b chunked": ("dpo", {**PP2, "cp_size": 2}, {**ONE_F_ONE_B, **RING, "loss_chunk_tokens": 7}),
        "pp2 x fsdp2 orpo interleaved": ("orpo", {**PP2, "dp_shard_size": 2}, {**INTERLEAVED, "pp_microbatches": 2}),
        "pp2 x fsdp2 simpo 1f1b": ("simpo", {**PP2, "dp_shard_size": 2}, ONE_F_ONE_B),
        # A full fine-tune: its reference a frozen copy of the starting checkpoint split into the same stages (its own
        # forward-only schedule); one process's is a plain copy of the model.
        "pp2 x fsdp2 full ft frozen reference 1f1b": ("dpo full", {**PP2, "dp_shard_size": 2}, ONE_F_ONE_B),
        # KTO: its rows, their KL rows (forward-only passes of their own) and labels; the loss on the last stage.
        "pp2 x fsdp2 kto 1f1b chunked": ("kto", {**PP2, "dp_shard_size": 2}, {**ONE_F_ONE_B, "loss_chunk_tokens": 7}),
    },
}


def full_model() -> torch.nn.Module:
    model = tiny_model("llama_4l")
    model.config.use_cache = False
    return model


def lora_model() -> torch.nn.Module:
    model = full_model()
    torch.manual_seed(1)
    model = apply_lora(model, LoraOptions(r=4, alpha=8))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _pairs(vocab: int, step: int, micro: int, pairs: int = PAIRS) -> dict[str, torch.Tensor]:
    """``pairs`` chosen rows, then their rejected rows (rows of different lengths and prompt masks). The second
    accumulated batch is shorter: a new shape builds a new schedule between accumulated batches, whose first run must
    not drop the gradients FSDP2 stages hold."""
    return make_batch(2 * pairs, SEQ - 4 * (micro % 2), vocab, seed=100 * step + micro)


def _unpaired(vocab: int, step: int, micro: int, pairs: int = PAIRS) -> dict[str, torch.Tensor]:
    """KTO's batch: ``2 * pairs`` rows as :func:`_pairs`, their KL rows (seed 21: the KL estimate above 0) and labels."""
    rows = _pairs(vocab, step, micro, pairs)
    kl = make_batch(2 * pairs, SEQ - 4 * (micro % 2), vocab, seed=21)
    label = torch.tensor([i % 3 != 1 for i in range(2 * pairs)])
    return {**rows, **{f"kl_{key}": value for key, value in kl.items()}, "label": label}


def _train(model, objective, take, clip, backward: bool) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    history, metrics = [], []
    batches = _unpaired if isinstance(objective, KTOObjective) else _pairs
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            loss, logged = objective(model, take(batches(model.config.vocab_size, step, micro)))
            if backward:
                (loss / ACCUM).backward()
            step_loss += loss.item() / ACCUM
            metrics.append({key: value.item() for key, value in logged.items()})
        norm = clip(params, MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        history += [step_loss, float(norm)]
    model.eval()
    with torch.no_grad():
        loss, logged = objective(model, take(batches(model.config.vocab_size, STEPS, 0, EVAL_PAIRS)))
    evaluation = {"loss": loss.item(), **{key: value.item() for key, value in logged.items()}}
    return {"history": history, "metrics": metrics, "eval": evaluation}


def _objective(method: str, reference: torch.nn.Module | None = None, checkpoint: str | None = None):
    """``method``'s objective; ``"dpo full"``: DPO of a full fine-tune against ``reference`` or a frozen copy of
    ``checkpoint``."""
    options = OBJECTIVES[method.split()[0]]
    if options.unpaired:
        return KTOObjective(options)
    return PreferenceObjective(options, reference=reference, checkpoint_dir=checkpoint)


@functools.cache
def _reference(method: str):
    full = method.endswith("full")
    model = full_model() if full else lora_model()
    reference = copy.deepcopy(model).requires_grad_(False).eval() if full else None
    run = _train(model, _objective(method, reference), lambda batch: batch, torch.nn.utils.clip_grad_norm_,
                 backward=True)  # fmt: skip
    return run, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _rows_of_rank(mesh):
    """This data rank's pairs (both halves), and this context-parallel rank's shard of each row."""
    dp = mesh["dp"]

    def take(batch):
        pairs = batch["input_ids"].shape[0] // 2
        share = -(-pairs // dp.size())
        first = min(dp.get_local_rank() * share, pairs)
        mine = range(first, min(first + share, pairs))
        rows = list(mine) + [pairs + i for i in mine]
        return context_parallel_batch({key: value[rows] for key, value in batch.items()}, mesh)

    return take


def _run_case(method: str, sizes: dict, settings: dict, checkpoint: str | None = None) -> dict:
    want, want_adapters = _reference(method)
    build = full_model if method.endswith("full") else lora_model
    model = build()
    parallelize(model, ParallelLayout(**sizes).resolve(dist.get_world_size()), *with_settings("test", **settings))
    _, pipeline = find_pipeline(model)
    pipeline.loss_scale = 1.0 / ACCUM  # the doors set it so (the schedule differentiates inside the model call)
    objective = _objective(method, checkpoint=checkpoint)
    got = _train(model, objective, _rows_of_rank(pipeline.mesh),
                 functools.partial(clip_grad_norm_, pipeline=pipeline), backward=False)  # fmt: skip
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in adapters.items()}
    start = {n: p.detach() for n, p in build().named_parameters() if p.requires_grad}
    return {
        "history_diff": max(abs(a - b) for a, b in zip(got["history"], want["history"])),
        "metrics_diff": max(abs(g[key] - w[key]) for g, w in zip(got["metrics"], want["metrics"]) for key in w),
        "names_match": [sorted(g) for g in got["metrics"]] == [sorted(w) for w in want["metrics"]],
        "eval_diff": max(abs(got["eval"][key] - want["eval"][key]) for key in want["eval"]),
        "eval_names_match": sorted(got["eval"]) == sorted(want["eval"]),
        "adapters": sorted(full),
        "adapter_diff": max((full[n] - want_adapters[n]).abs().max().item() for n in full),
        "adapter_change": max((want_adapters[n] - start[n]).abs().max().item() for n in start),
        "all_adapters": sorted(want_adapters),
        # A full fine-tune's frozen copy: this rank holds what the policy holds (the same stages, shards), frozen.
        "reference_numel": sum(p.numel() for p in getattr(objective.reference, "parameters", list)()),
        "reference_trainable": any(p.requires_grad for p in getattr(objective.reference, "parameters", list)()),
        "policy_numel": sum(p.numel() for p in model.parameters()),
        "smallest_kl": min(g.get("kl", 0.0) for g in got["metrics"]),  # KTO's KL estimate, clamped at 0
    }


def _check(name: str, rank: int, result: dict) -> None:
    where = (name, rank, result)
    assert result["history_diff"] <= TOL and result["metrics_diff"] <= TOL, where
    assert result["eval_diff"] <= TOL, where
    assert result["adapter_diff"] <= TOL, where
    assert result["adapter_change"] > 100 * TOL, where  # the adapters moved: parity means something
    assert result["names_match"] and result["eval_names_match"], where  # TRL's metrics, as one process logs them
    if "kto" in name:  # the KL term is live (never clamped to 0), so its parity means something
        assert result["smallest_kl"] > 100 * TOL, where
    if "full" in name:  # the frozen copy is split and sharded as the policy is
        assert result["reference_numel"] == result["policy_numel"] and not result["reference_trainable"], where


def _check_every_adapter_trained(name: str, results: list[dict]) -> None:
    """Every adapter of the model is trained on some pipeline rank (each holds its stages' layers only)."""
    assert sorted({n for result in results for n in result["adapters"]}) == results[0]["all_adapters"], name


def check_in_rank(rank: int, world_size: int) -> None:
    """The 2-rank cases, checked on each rank of a world another test launched (the pipeline parity world)."""
    for name, case in CASES[world_size].items():
        result = _run_case(*case)
        _check(name, rank, result)
        every: list[dict] = [{}] * world_size
        dist.all_gather_object(every, {"adapters": result["adapters"], "all_adapters": result["all_adapters"]})
        _check_every_adapter_trained(name, every)


def _world(rank: int, world_size: int, out_dir: str, names: tuple[str, ...] = ()) -> None:
    checkpoint = str(Path(out_dir, "starting_checkpoint"))
    if rank == 0:  # the full fine-tune's starting checkpoint, which its frozen reference is read from
        full_model().save_pretrained(checkpoint)
    dist.barrier()
    cases = {name: case for name, case in CASES[world_size].items() if name in names or not names}
    results = {name: _run_case(*case, checkpoint if case[0].endswith("full") else None) for name, case in cases.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results(world_size: int) -> list[dict]:
    return world_json(_world, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES[4]))
def test_preference_under_pipeline_matches_one_process(name: str) -> None:
    results = [result[name] for result in _results(4)]
    for rank, result in enumerate(results):
        _check(name, rank, result)
    _check_every_adapter_trained(name, results)
