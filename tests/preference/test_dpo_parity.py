"""DPO with LoRA trains exactly as one process under FSDP2, tensor parallelism (sequence parallel, loss parallel),
context parallelism (ring and Ulysses) and expert parallelism on a mixture of experts (with FSDP2 over the rest).

fp32, gloo, one launched world of 2 ranks checking every case. Each micro-batch holds PAIRS chosen rows then their
PAIRS rejected rows; data-parallel ranks take whole pairs (both halves of a pair on the same rank); context-parallel
ranks take the load-balanced shards of every row (`context_parallel_batch`), whose partial log-probabilities are
summed over the cp ranks. The reference of DPO is the base with the adapters disabled (peft's ``disable_adapter()``)
in the same model. SGD with momentum, two micro-batches accumulated, clipping that triggers, random non-zero
``lora_B`` (policy and reference differ from the start). The one-process run computes its log-probabilities from the
full logits of a plain peft model; the parallel runs through the engine's loss path: the chunked head (per-token
mode, several chunks), or without chunking the (vocab-sharded, under loss parallel) logits. The mixture of experts
(tiny Qwen3-MoE, LoRA on attention and on the routed experts' fused weights) has its router's balance loss on with a
large coefficient, added as TRL adds it (one process: transformers' own ``aux_loss``; expert parallel: the global
batch's). Compared: per-step losses and pre-clip gradient norms, TRL's metrics of every micro-batch, and the final
adapters, to 1e-5.

Also: a full fine-tune against its frozen reference copy (FSDP2, TP, CP ring; slow: CP Ulysses and EP on the MoE,
whose experts the copy splits as the policy's), and KTO with LoRA (its rows, their KL rows, desirable or not; the KL
estimate never clamped to 0 here) under FSDP2, TP, CP ring (each KL row sharded as its row is); slow: CP Ulysses, EP
with the router loss, CP x TP. And packed pairs (``data.packing``: whole pairs per row, each sequence a document with
positions from 0, the log-probabilities summed per sequence) under FSDP2 (the data ranks holding 3 and 1 pairs), CP
ring and CP Ulysses, against the same unpacked one-process run; slow: TP with SP and loss parallel, FSDP2 x CP Ulysses.
"""

from __future__ import annotations

import copy
import functools
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import world_json
from test_packed_pairs import pairs_of
from tiny_models import CONFIGS, make_batch, tiny_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.data.packing import collate_packed_pairs, pack_pairs
from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel import clip_grad_norm_, context_parallel_batch, mesh_of
from lightning_plugins.parallel.options import with_settings
from lightning_plugins.parallel.pipeline.apply import _PIPELINE_ATTR
from lightning_plugins.parallel.quantized import is_nf4
from lightning_plugins.preference import KTOObjective, PreferenceObjective, PreferenceOptions
from lightning_plugins.preference.logps import find_parallel_loss, sequence_logps

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS, ACCUM, PAIRS, SEQ, MAX_NORM, LR, TOL = 3, 2, 4, 13, 0.05, 1.0, 1e-5
OBJECTIVE = PreferenceOptions(method="dpo", beta=0.5)
TP2, CP2 = {"tp_size": 2}, {"cp_size": 2}
#: LoRA on the routed experts' fused 3-D weights (peft's target_parameters), besides attention.
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
# world -> name -> (family, layout sizes, parallel/memory settings); a world's size is its name's number.
CASES = {
    "2": {
        "fsdp2 chunked": ("llama", {"dp_shard_size": 2}, {"loss_chunk_tokens": 7}),
        "tp2 sp+lp chunked": ("llama", TP2, {"loss_chunk_tokens": 7}),
        "tp2 sp+lp logits": ("llama", TP2, {"loss_chunk_tokens": None}),
        "cp2 ring chunked": ("llama", CP2, {"cp_backend": "ring", "loss_chunk_tokens": 7}),
        "cp2 ulysses logits": ("llama", CP2, {"cp_backend": "ulysses", "loss_chunk_tokens": None}),
        "qwen3_moe ep2 router loss": ("qwen3_moe", {"ep_size": 2}, {"loss_chunk_tokens": 7}),
        # A full fine-tune: the reference is a frozen copy of the starting checkpoint, built on meta, laid out like
        # the policy and loaded sharded (frozen_reference); one process's is a plain copy of the model.
        "fsdp2 full ft frozen reference": ("llama", {"dp_shard_size": 2}, {"loss_chunk_tokens": 7}),
        "tp2 sp+lp full ft frozen reference": ("llama", TP2, {"loss_chunk_tokens": None}),
        "cp2 ring full ft frozen reference": ("llama", CP2, {"cp_backend": "ring", "loss_chunk_tokens": 7}),
        # QLoRA: the reference is the NF4 base with the adapters disabled; one process trains the same NF4 model.
        "fsdp2 qlora nf4 chunked": ("llama", {"dp_shard_size": 2}, {"loss_chunk_tokens": 7}),
        # KTO (unpaired rows, their KL rows, desirable or not) with LoRA: its KL estimate and loss are global means;
        # under CP each KL row is sharded as its row is (shard_batch_for_context_parallel's kl_ keys).
        "fsdp2 kto chunked": ("llama", {"dp_shard_size": 2}, {"loss_chunk_tokens": 7}),
        "tp2 sp+lp kto logits": ("llama", TP2, {"loss_chunk_tokens": None}),
        "cp2 ring kto chunked": ("llama", CP2, {"cp_backend": "ring", "loss_chunk_tokens": 7}),
        # Packed pairs (data.packing): whole pairs per row, each sequence a document, against the unpacked one
        # process; FSDP2's data ranks hold 3 and 1 pairs (one packed row each), its attention masked by document;
        # CP shards the rows and its attention keeps the documents apart (ring and Ulysses).
        "fsdp2 packed chunked": ("llama", {"dp_shard_size": 2}, {"loss_chunk_tokens": 7}),
        "cp2 ring packed chunked": ("llama", CP2, {"cp_backend": "ring", "loss_chunk_tokens": 7}),
        "cp2 ulysses packed logits": ("llama", CP2, {"cp_backend": "ulysses", "loss_chunk_tokens": None}),
    },
    # The same 2 ranks, slow: the other CP backend and the mixture of experts under KTO, and the experts' full
    # fine-tune (its frozen reference's experts split over the ep ranks as the policy's).
    "2 slow": {
        "cp2 ulysses kto logits": ("llama", CP2, {"cp_backend": "ulysses", "loss_chunk_tokens": None}),
        "qwen3_moe ep2 kto router loss": ("qwen3_moe", {"ep_size": 2}, {"loss_chunk_tokens": 7}),
        "qwen3_moe ep2 full ft frozen reference": ("qwen3_moe", {"ep_size": 2}, {"loss_chunk_tokens": 7}),
        "cp2 ulysses full ft frozen reference": ("llama", CP2, {"cp_backend": "ulysses", "loss_chunk_tokens": None}),
        # Packed pairs under TP with sequence and loss parallelism (the masked path by document on the gathered rows).
        "tp2 sp+lp packed logits": ("llama", TP2, {"loss_chunk_tokens": None}),
    },
    # Compositions (slow): a row's log-probability summed over cp shards of vocab-sharded chunks, and the experts
    # split over 2 ranks and FSDP2-sharded over the other 2 (ep2 inside dp_shard 4), one pair a data rank.
    "4": {
        "cp2 x tp2 sp+lp ring chunked": ("llama", {**CP2, **TP2}, {"cp_backend": "ring", "loss_chunk_tokens": 7}),
        "qwen3_moe ep2 x fsdp4 router loss": ("qwen3_moe", {"ep_size": 2, "dp_shard_size": 4}, {}),
        "cp2 x tp2 sp+lp kto ring chunked": ("llama", {**CP2, **TP2}, {"cp_backend": "ring", "loss_chunk_tokens": 7}),
        # Packed pairs: the data ranks' packed rows (3 and 1 pairs), each sharded over the cp ranks.
        "fsdp2 x cp2 ulysses packed chunked": ("llama", {"dp_shard_size": 2, **CP2},
                                               {"cp_backend": "ulysses", "loss_chunk_tokens": 7}),
    },
}

#: Cases that train every weight (no LoRA) against a frozen reference copy.
FULL = {name for cases in CASES.values() for name in cases if "full ft" in name}
#: Cases that train KTO on unpaired examples instead of DPO on pairs.
KTO_CASES = {name for cases in CASES.values() for name in cases if "kto" in name}
KTO = PreferenceOptions(method="kto", beta=0.5, desirable_weight=1.3, undesirable_weight=0.7)
#: The KL rows' tokens: with them every KTO case's KL estimate is above 0 (not clamped) in every micro-batch.
KL_SEED = 13
#: Cases whose base is NF4 (QLoRA, torchao).
QLORA = {name for cases in CASES.values() for name in cases if "qlora" in name}
#: Cases that train packed pairs (rows of PACKED_LEN tokens: first fit puts pairs 0, 1, 3 in one row, pair 2 alone).
PACKED = {name for cases in CASES.values() for name in cases if "packed" in name}
PACKED_LEN = 66


def full_model(family: str) -> torch.nn.Module:
    if family == "qwen3_moe":  # the router's balance loss on, weighted enough that a wrong reduction shows
        torch.manual_seed(0)
        config = CONFIGS[family]()
        config.output_router_logits, config.router_aux_loss_coef = True, 0.5
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = tiny_model(family)
    model.config.use_cache = False
    return model


def lora_model(family: str, quantize: bool = False) -> torch.nn.Module:
    model = full_model(family)
    if family == "qwen3_moe":
        options = LoraOptions(r=4, alpha=8, target_modules=("q_proj", "v_proj"), target_parameters=EXPERT_WEIGHTS)
    else:
        options = LoraOptions(r=4, alpha=8, quantize="nf4" if quantize else "none")
    torch.manual_seed(1)
    model = apply_lora(model, options)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _pairs(vocab: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    """PAIRS chosen rows, then their rejected rows (rows of different lengths and prompt masks)."""
    return make_batch(2 * PAIRS, SEQ, vocab, seed=100 * step + micro)


def _unpaired(vocab: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    """2 * PAIRS unpaired rows with their KL rows (as collate_unpaired lays them out) and labels, mixed."""
    rows = make_batch(2 * PAIRS, SEQ, vocab, seed=100 * step + micro)
    kl = make_batch(2 * PAIRS, SEQ, vocab, seed=KL_SEED)
    label = torch.tensor([i % 3 != 1 for i in range(2 * PAIRS)])
    return {**rows, **{f"kl_{key}": value for key, value in kl.items()}, "label": label}


def _train(model, take, clip, objective=None) -> tuple[list[float], list[dict[str, float]]]:
    objective = objective or PreferenceObjective(OBJECTIVE)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    history, metrics = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            batches = _unpaired if isinstance(objective, KTOObjective) else _pairs
            loss, logged = objective(model, take(batches(model.config.vocab_size, step, micro)))
            (loss / ACCUM).backward()
            step_loss += loss.item() / ACCUM
            metrics.append({key: value.item() for key, value in logged.items()})
        norm = clip(params, MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        history += [step_loss, float(norm)]
    return history, metrics


@functools.cache
def _reference(family: str, full: bool = False, quantize: bool = False, kto: bool = False):
    model = full_model(family) if full else lora_model(family, quantize)
    objective = KTOObjective(KTO) if kto else None
    if full:  # one process: the reference is a plain frozen copy of the starting model
        objective = PreferenceObjective(OBJECTIVE, reference=copy.deepcopy(model).requires_grad_(False).eval())
    history, metrics = _train(model, lambda batch: batch, torch.nn.utils.clip_grad_norm_, objective)
    return history, metrics, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def _rows_of_rank(model, packed: bool = False):
    """This data rank's pairs (its share of the chosen rows and the same share of the rejected rows; packed: its
    share of the packed rows), and this context-parallel rank's shard of each row."""
    mesh = mesh_of(model)
    dp = mesh["dp"]
    if packed:
        def take(batch):
            rows = pack_pairs(pairs_of(batch), PACKED_LEN)
            assert len(rows) == 2 and len(rows) % dp.size() == 0
            mine = rows[dp.get_local_rank() :: dp.size()]
            return context_parallel_batch(collate_packed_pairs(mine, 0, PACKED_LEN), mesh)

        return take
    share = PAIRS // dp.size()
    first = dp.get_local_rank() * share
    rows = list(range(first, first + share)) + list(range(PAIRS + first, PAIRS + first + share))
    return lambda batch: context_parallel_batch({key: value[rows] for key, value in batch.items()}, mesh)


def _run_case(
    family: str, sizes: dict, settings: dict, checkpoint: Path | None = None, quantize: bool = False, kto: bool = False,
    packed: bool = False,
) -> dict:  # fmt: skip
    build = full_model if checkpoint is not None else functools.partial(lora_model, quantize=quantize)
    want_history, want_metrics, want_adapters = _reference(family, checkpoint is not None, quantize, kto)
    model = build(family)
    parallelize(model, ParallelLayout(**sizes).resolve(dist.get_world_size()), *with_settings("test", **settings))
    chunked = find_parallel_loss(model).chunked is not None
    objective = PreferenceObjective(OBJECTIVE, checkpoint_dir=checkpoint) if checkpoint is not None else None
    objective = KTOObjective(KTO) if kto else objective
    history, metrics = _train(model, _rows_of_rank(model, packed), clip_grad_norm_, objective)
    layout = _reference_layout(objective, model, family) if checkpoint is not None else {}
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in adapters.items()}
    start = {n: p.detach() for n, p in build(family).named_parameters() if p.requires_grad}
    return {
        "chunked": chunked,
        "history_diff": max(abs(a - b) for a, b in zip(history, want_history)),
        "metrics_diff": max(abs(got[key] - want[key]) for got, want in zip(metrics, want_metrics) for key in want),
        "metric_names": sorted({key for got in metrics for key in got}),
        "names_match": [sorted(got) for got in metrics] == [sorted(want) for want in want_metrics],
        "adapter_diff": max((full[n] - want_adapters[n]).abs().max().item() for n in want_adapters),
        "adapter_change": max((want_adapters[n] - start[n]).abs().max().item() for n in start),
        "smallest_kl": min(got.get("kl", 0.0) for got in metrics),  # KTO: its KL estimate, clamped at 0
        **layout,
        "nf4_weights": sum(is_nf4(p) for p in model.parameters()),
    }


def _reference_layout(objective: PreferenceObjective, model: torch.nn.Module, family: str) -> dict:
    """How the frozen reference sits next to the policy: same placements and local shapes, nothing trainable, its
    weights still the starting ones."""
    reference, start = objective.reference, dict(full_model(family).named_parameters())
    policy = dict(model.named_parameters())
    mine = dict(reference.named_parameters())
    differ = [
        n for n in policy
        if n not in mine or type(mine[n]) is not type(policy[n]) or _local(mine[n]).shape != _local(policy[n]).shape
        or getattr(mine[n], "placements", None) != getattr(policy[n], "placements", None)
    ]  # fmt: skip
    return {
        "layout_differs": differ + sorted(set(mine) - set(policy)),
        "frozen": not any(p.requires_grad for p in mine.values()) and not reference.training,
        "reference_diff": max((_full(mine[n]) - start[n].detach()).abs().max().item() for n in start),
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _world(rank: int, world_size: int, out_dir: str, world: str) -> None:
    cases = CASES[world]
    if rank == 0:  # the full fine-tunes' starting checkpoints, which their frozen references are read from
        for family in {family for name, (family, _, _) in cases.items() if name in FULL}:
            full_model(family).save_pretrained(Path(out_dir, f"start_{family}"))
    dist.barrier()
    results = {}
    for name, (family, sizes, settings) in cases.items():
        began = time.perf_counter()
        results[name] = _run_case(family, sizes, settings, Path(out_dir, f"start_{family}") if name in FULL else None,
                                  name in QLORA, name in KTO_CASES, name in PACKED)  # fmt: skip
        results[name]["seconds"] = time.perf_counter() - began  # what each case costs the world
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results(world: str) -> list[dict]:
    return world_json(functools.partial(_world, world=world), int(world.split()[0]))


@pytest.mark.parametrize(
    ("world", "name"),
    [pytest.param(world, name, marks=[pytest.mark.slow] if world != "2" else []) for world in CASES
     for name in CASES[world]],
    ids=str,
)  # fmt: skip
def test_dpo_matches_one_process(world: str, name: str) -> None:
    family, _, settings = CASES[world][name]
    for rank, result in enumerate(_results(world)):
        where = (name, rank, result[name])
        assert result[name]["history_diff"] <= TOL and result[name]["metrics_diff"] <= TOL, where
        assert result[name]["adapter_diff"] <= TOL, where
        assert result[name]["adapter_change"] > 100 * TOL, where  # the adapters moved: parity means something
        assert result[name]["chunked"] == (settings.get("loss_chunk_tokens", 1) is not None), where
        assert result[name]["names_match"], where  # every micro-batch logged what one process logged
        # The mixture of experts' router loss is in the loss and logged (TRL's aux_loss); dense models log none.
        assert ("aux_loss" in result[name]["metric_names"]) == (family == "qwen3_moe"), where
        if name in FULL:  # the reference: laid out like the policy, frozen, still the starting weights
            assert result[name]["layout_differs"] == [] and result[name]["frozen"], where
            assert result[name]["reference_diff"] == 0.0, where
        assert ("kl" in result[name]["metric_names"]) == (name in KTO_CASES), where  # KTO logs its KL estimate
        if name in KTO_CASES:  # and the KL term is live (never clamped to 0), so its parity means something
            assert result[name]["smallest_kl"] > 100 * TOL, where
        if name in QLORA:  # the base stayed 4-bit under FSDP2
            assert result[name]["nf4_weights"] > 0, where


def test_the_router_loss_is_added_as_trl_adds_it() -> None:
    """TRL's DPOTrainer: ``loss + router_aux_loss_coef * outputs.aux_loss`` of the policy's forward (its reference
    forward computes none); the router loss logged as ``aux_loss``."""
    model = lora_model("qwen3_moe")
    batch = _pairs(model.config.vocab_size, 0, 0)
    objective = PreferenceObjective(OBJECTIVE)
    loss, metrics = objective(model, batch)
    aux = model(**batch).aux_loss.detach()  # transformers' own balance loss of the batch
    policy = sequence_logps(model, batch)
    with torch.no_grad(), model.disable_adapter():
        reference = sequence_logps(model, batch, router_loss=False)
    assert reference.aux_loss is None and aux > 0
    without, _ = objective.from_logps(replace(policy, aux_loss=None), reference)
    torch.testing.assert_close(metrics["aux_loss"], aux, rtol=0, atol=TOL)
    coef = model.config.router_aux_loss_coef
    torch.testing.assert_close(loss.detach(), without.detach() + coef * aux, rtol=0, atol=TOL)


def test_sequence_logps_refuses_a_pipeline_by_name() -> None:
    """A model split into stages has no whole forward: PreferenceObjective runs it through its schedule instead
    (tests/preference/test_dpo_pipeline.py)."""
    model = lora_model("llama")
    setattr(model.base_model.model, _PIPELINE_ATTR, object())  # what parallelize leaves on a model split into stages
    with pytest.raises(OptionsError, match=r"but \w+ is split into pipeline stages.*Call PreferenceObjective"):
        sequence_logps(model, _pairs(model.config.vocab_size, 0, 0))


def test_precomputed_reference_logps_train_as_the_reference_forward() -> None:
    """``objective.reference: precomputed`` in one's own loop: the reference's log-probabilities of every batch taken
    in one pass before training (the base, adapters disabled) and handed back as ``batch["ref_logps"]`` train exactly
    as the reference forward of each step does (the policy moves, the reference does not)."""
    from lightning_plugins.preference.reference import precompute_reference_logps

    vocab = CONFIGS["llama"]().vocab_size
    batches = [_pairs(vocab, step, micro) for step in range(STEPS) for micro in range(ACCUM)]
    given = precompute_reference_logps(PreferenceObjective(OBJECTIVE), lora_model("llama"), batches)
    carried = iter(given)
    model = lora_model("llama")
    with_given = lambda batch: {**batch, "ref_logps": next(carried)}
    history, metrics = _train(model, with_given, torch.nn.utils.clip_grad_norm_)
    want_history, want_metrics, want_adapters = _reference("llama")
    assert max(abs(a - b) for a, b in zip(history, want_history)) <= TOL
    assert max(abs(got[key] - want[key]) for got, want in zip(metrics, want_metrics) for key in want) <= TOL
    assert all(sorted(got) == sorted(want) for got, want in zip(metrics, want_metrics))
    adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert max((adapters[n] - want_adapters[n]).abs().max().item() for n in want_adapters) <= TOL
    with pytest.raises(ValueError, match=r"batch\['ref_logps'\] holds \(3,\) values for 8 rows"):
        PreferenceObjective(OBJECTIVE)(model, {**batches[0], "ref_logps": torch.zeros(3)})
