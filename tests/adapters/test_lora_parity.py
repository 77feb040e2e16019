"""LoRA through `parallelize` trains exactly as single-process peft LoRA; adapters export and load back.

fp32, gloo, SGD with momentum (a wrong gradient scale shows in the weights), gradient accumulation over 2
micro-batches, clipping that triggers (through ``lightning_plugins.parallel.clip_grad_norm_``), rows of
different lengths with ``-100`` labels, and random non-zero ``lora_B`` so every adapter half gets a
gradient. Per case: per-step losses and pre-clip gradient norms, the final adapters (gathered), the frozen
base bit-identical to its start and never given a gradient, the optimizer holding the adapters only (and
state for each), tensor-parallel peers holding identical copies of every replicated parameter, and no
asynchronous collective left unwaited (recomputation under activation checkpointing stops early). Cases
marked ``inner`` pass the transformers model inside the PeftModel, which is what the Lightning strategies
find; the others pass the PeftModel. Cases with ``dropout`` train with LoRA dropout on under tensor
parallelism and still match one process (whose masks the ranks reproduce). Cases with ``export`` write the
adapter and the merged weights with ``export_hf`` and load them in plain peft / transformers with the
reference's logits. One world of 2 ranks and one of 4 check every case (starting ranks is the slow part);
the reference runs on each rank. Mixture-of-experts cases train LoRA on the routed experts (`lora.target_parameters`),
the router in full (`lora.modules_to_save`), and LoRA dropout inside the token-local block under tensor parallelism.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _launch import world_json
from peft import LoraConfig, PeftModel, get_peft_model
from tiny_models import make_batch, tiny_model
from torch import nn
from torch._C._distributed_c10d import _get_work_registry_size
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import AutoModelForCausalLM

from lightning_plugins import LayoutError, OptionsError, ParallelLayout, ParallelOptions, parallelize
from lightning_plugins.checkpoint.live_export import export_hf
from lightning_plugins.adapters.lora import LoraOptions, apply_lora, trainable_parameters
from lightning_plugins.parallel.options import with_settings
from lightning_plugins.parallel import clip_grad_norm_, context_parallel_batch, mesh_of, pipeline_of

# peft's get_peft_model reads a transformers attribute deprecated in 5.x: third-party noise.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS, ACCUM, BATCH, SEQ, MAX_NORM, LR = 4, 2, 4, 15, 0.05, 1.0
TOL = 1e-5
RANK, ALPHA = 4, 8
#: LoRA layers per decoder layer with the default targets (q/k/v/o, gate/up/down).
PROJECTIONS = 7

TP2 = {"tp_size": 2}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
#: peft LoRA on the fused 3-D expert weights (its ParamWrapper), run by the engine's grouped experts forward.
EXPERT_WEIGHTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
#: peft's modules_to_save: Mixtral's router, trained in full.
ROUTER = ["gate"]
# name -> (family, layout sizes, parallel/memory options, case flags)
CASES: dict[int, dict[str, tuple[str, dict, dict, dict]]] = {
    2: {
        "llama tp2 sp+lp dropout": ("llama", TP2, {}, {"dropout": 0.1}),
        "llama tp2 dropout": ("llama", TP2, {"sequence_parallel": False, "loss_parallel": False}, {"dropout": 0.1}),
        "qwen3 tp2 full-ac dropout": (
            "qwen3", TP2, {"activation_checkpointing": "full"}, {"dropout": 0.1, "inner": True}
        ),
        "gemma tp2 (fallback plan)": ("gemma", TP2, {}, {}),
        "llama fsdp2": ("llama", {"dp_shard_size": 2}, {}, {"export": True}),
        "llama fsdp2 lm_head adapted": (
            "llama", {"dp_shard_size": 2}, {}, {"targets": ("v_proj", "lm_head"), "export": True}
        ),
        "llama pp2 1f1b": ("llama_4l", {"pp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}, {"export": True}),
        # Stages of a family whose forward is not Llama's (scaled embeddings, soft-capped logits, tied head).
        "gemma2 pp2 interleaved": (
            "gemma2", {"pp_size": 2}, {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2}, {}
        ),
        "llama cp2 ulysses": ("llama", {"cp_size": 2}, {"cp_backend": "ulysses"}, {}),
        "llama cp2 ring": ("llama", {"cp_size": 2}, {"cp_backend": "ring"}, {"inner": True}),
        "llama tp2 export": ("llama_tied", TP2, {}, {"export": True}),
        # Mixture-of-experts: LoRA on attention, and on the routed experts (case flag "experts").
        "mixtral attention fsdp2": ("mixtral", {"dp_shard_size": 2}, {}, {"targets": ATTENTION}),
        "mixtral attention+experts ep2": ("mixtral", {"ep_size": 2}, {}, {"targets": ATTENTION, "experts": True}),
        "mixtral attention+experts tp2 sp": ("mixtral", TP2, {}, {"targets": ATTENTION, "experts": True}),
        # Default targets: attention and the shared expert's MLP, which runs (adapted) in the token-local block.
        "qwen2_moe tp2 default targets": ("qwen2_moe", TP2, {}, {}),
        # LoRA dropout on the shared expert, inside the token-local block: each rank draws one process's mask of
        # the whole sequence and keeps its tokens' rows (SEQ is odd: the shards are uneven).
        "qwen2_moe tp2 sp dropout": ("qwen2_moe", TP2, {}, {"dropout": 0.1}),
        "qwen2_moe tp2 dropout": ("qwen2_moe", TP2, {"sequence_parallel": False, "loss_parallel": False}, {"dropout": 0.1}),
        # The router trained in full runs in the token-local block too, replicated over tp.
        "mixtral router+experts tp2 sp": ("mixtral", TP2, {}, {"targets": ATTENTION, "experts": True, "router": True}),
        # The router trained in full (peft's modules_to_save), with expert LoRA: exported with the adapters.
        "mixtral router+experts ep2": (
            "mixtral", {"ep_size": 2}, {}, {"targets": ATTENTION, "experts": True, "router": True, "export": True}
        ),
        "mixtral router fsdp2": ("mixtral", {"dp_shard_size": 2}, {}, {"targets": ATTENTION, "router": True, "export": True}),
        "qwen3_moe experts fsdp2": (
            "qwen3_moe", {"dp_shard_size": 2}, {}, {"targets": ("q_proj",), "experts": True, "inner": True}
        ),
    },
    4: {
        "llama tp2 x fsdp2 sp+lp selective-ac": (
            "llama", {"tp_size": 2, "dp_shard_size": 2}, {"activation_checkpointing": "selective"}, {"export": True}
        ),
        "qwen2 tp2 x fsdp2": (
            "qwen2", {"tp_size": 2, "dp_shard_size": 2}, {"sequence_parallel": False}, {"inner": True}
        ),
        # Data ranks draw dropout masks for their own rows, so no parity with one process; ranks seeded apart
        # before `parallelize` must still agree within each tensor-parallel group (replicated halves stay equal).
        "llama tp2 x fsdp2 dropout, ranks seeded apart": (
            "llama", {"tp_size": 2, "dp_shard_size": 2}, {}, {"dropout": 0.1, "seeded_apart": True}
        ),
        # Pipeline stages with context-parallel (ring) attention; FSDP2 shards each stage over the cp ranks.
        "llama pp2 x cp2 ring 1f1b": (
            "llama_4l",
            {"pp_size": 2, "cp_size": 2},
            {"pp_schedule": "1f1b", "pp_microbatches": 2, "cp_backend": "ring"},
            {"inner": True},
        ),
    },
}


def lora_model(
    family: str,
    dropout: float = 0.0,
    targets: tuple[str, ...] | None = None,
    experts: bool = False,
    router: bool = False,
) -> PeftModel:
    """A tiny model with LoRA on ``targets`` (default: every projection), on the expert weights too with
    ``experts``, the router trained in full with ``router``, and random non-zero ``lora_B`` (peft starts it at zero,
    where ``lora_A`` would get no gradient)."""
    model = tiny_model(family)
    model.config.use_cache = False
    torch.manual_seed(1)
    options = LoraOptions(
        r=RANK,
        alpha=ALPHA,
        dropout=dropout,
        target_modules=targets,
        target_parameters=EXPERT_WEIGHTS if experts else None,
        modules_to_save=ROUTER if router else None,
    )
    peft_model = apply_lora(model, options)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return peft_model


def _batch(vocab: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    return make_batch(BATCH, SEQ, vocab, seed=100 * step + micro)


def _train(model: nn.Module, prepare, clip, seed: int | None = 3) -> tuple[list[float], torch.optim.Optimizer]:
    """STEPS optimizer steps of ACCUM micro-batches; per-step losses then pre-clip gradient norms.

    Under PP ``model(**batch)`` already ran forward and backward (the schedule does). ``seed``: seeds the
    dropout masks (``None`` keeps the generator as it is).
    """
    params = trainable_parameters(model)
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    pipeline = pipeline_of(model)
    if pipeline is not None:
        pipeline.loss_scale = 1.0 / ACCUM
    if seed is not None:
        torch.manual_seed(seed)  # the reference's dropout masks (tensor-parallel ranks draw them alike)
    model.train()
    losses, norms = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            loss = model(**prepare(_batch(model.config.vocab_size, step, micro))).loss / ACCUM
            if loss.requires_grad:
                loss.backward()
            step_loss += loss.item()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad), "the frozen base got a gradient"
        norm = clip(params, MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        norms.append(float(norm))
    return losses + norms, optimizer


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


@functools.cache
def _reference(
    family: str, dropout: float, targets: tuple[str, ...] | None, experts: bool, router: bool
) -> tuple[list[float], PeftModel]:
    model = lora_model(family, dropout, targets, experts, router)
    history, _ = _train(model, lambda batch: batch, torch.nn.utils.clip_grad_norm_)
    return history, model


def _prepare(model: nn.Module):
    """This rank's rows of each batch (data-parallel ranks split them), sharded along the sequence under CP."""
    mesh = mesh_of(model)
    dp = mesh["dp"]
    rows = BATCH // dp.size()
    local = slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)
    return lambda batch: context_parallel_batch({k: v[local] for k, v in batch.items()}, mesh)


def _logits(model: nn.Module) -> torch.Tensor:
    batch = make_batch(2, SEQ, model.config.vocab_size, seed=7)
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def _run_case(world_size: int, tmp: str, name: str, family: str, sizes: dict, options: dict, flags: dict) -> dict:
    dropout, targets, experts = flags.get("dropout", 0.0), flags.get("targets"), flags.get("experts", False)
    router = flags.get("router", False)
    ref_history, reference = _reference(family, dropout, targets, experts, router)
    peft_model = lora_model(family, dropout, targets, experts, router)
    initial = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    layout = ParallelLayout(**sizes).resolve(world_size)
    # A PeftModel, or the transformers model inside it (what the Lightning strategies find).
    target = peft_model.get_base_model() if flags.get("inner") else peft_model
    if flags.get("seeded_apart"):
        torch.manual_seed(100 + dist.get_rank())  # parallelize must give tensor-parallel peers one generator
    assert parallelize(target, layout, *with_settings("test", **options)) is target
    assert mesh_of(peft_model) is not None
    pipeline = pipeline_of(peft_model)
    clip = pipeline.clip_grad_norm_ if pipeline is not None else clip_grad_norm_
    history, optimizer = _train(peft_model, _prepare(peft_model), clip, None if flags.get("seeded_apart") else 3)

    expected = dict(reference.named_parameters())
    adapter_diff = base_moved = 0.0
    adapters = held = 0
    for n, param in peft_model.named_parameters():
        full = _full(param)
        if param.requires_grad:
            adapters += 1
            adapter_diff = max(adapter_diff, (full - expected[n].detach()).abs().max().item())
        else:
            base_moved = max(base_moved, (full - initial[n]).abs().max().item())
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {id(p): n for n, p in peft_model.named_parameters()}
    held = sum(1 for p in in_optimizer if "lora_" in names[p] or "modules_to_save" in names[p])
    # FSDP2 shards the frozen base too (it is a DTensor split over the data ranks).
    fsdp = mesh_of(peft_model)["dp_shard_cp"].size() > 1
    base_sharded = all(
        isinstance(p, DTensor) and Shard(0) in p.placements for p in peft_model.parameters() if not p.requires_grad
    )
    result = {
        "loss_diff": max(abs(a - b) for a, b in zip(history[:STEPS], ref_history[:STEPS])),
        "norm_diff": max(abs(a - b) for a, b in zip(history[STEPS:], ref_history[STEPS:])),
        "adapter_diff": adapter_diff,
        "adapter_change": max((expected[n].detach() - initial[n]).abs().max().item() for n in initial if "lora_" in n),
        # The router's trained copy (modules_to_save), compared above with the adapters: it must have moved.
        "router_change": max(
            ((expected[n].detach() - initial[n]).abs().max().item() for n in initial if "modules_to_save" in n),
            default=None,
        ),
        "router": router,
        "base_moved": base_moved,
        "adapters": adapters,
        "all_adapters": sum(p.requires_grad for p in reference.parameters()),
        "optimizer_params": len(in_optimizer),
        "optimizer_adapters": held,
        "optimizer_state": len(optimizer.state),
        "base_sharded": float(base_sharded) if fsdp else 1.0,
        "pipeline": pipeline is not None,
        "pp_size": mesh_of(peft_model)["pp"].size(),
        "tp_spread": _tp_spread(peft_model),
        "parity": not flags.get("seeded_apart"),
    }
    if flags.get("export"):
        # peft merges no modules_to_save copy: such an adapter is exported as an adapter only.
        result.update(_export(peft_model, reference, family, Path(tmp) / name.replace(" ", "_"), merge=not router))
    # Every asynchronous collective was waited for (activation checkpointing's recomputation included).
    result["unwaited_collectives"] = _get_work_registry_size()
    return result


def _tp_spread(model: nn.Module) -> float:
    """The largest difference between tensor-parallel peers' copies of a replicated parameter (must be 0)."""
    spread = 0.0
    for param in model.parameters():
        if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
            continue
        if not isinstance(param.placements[param.device_mesh.mesh_dim_names.index("tp")], Replicate):
            continue
        local = param.to_local().detach().contiguous()
        copies = [torch.empty_like(local) for _ in range(param.device_mesh["tp"].size())]
        dist.all_gather(copies, local, group=param.device_mesh.get_group("tp"))
        spread = max(spread, max((c - local).abs().max().item() for c in copies))
    return spread


def _export(model: nn.Module, reference: PeftModel, family: str, out: Path, merge: bool) -> dict[str, float]:
    """Adapter (and with ``merge`` merged) exports from every rank, loaded in one process by plain peft /
    transformers."""
    adapter_dir = export_hf(model, out / "adapter")
    merged_dir = export_hf(model, out / "merged", merge=True) if merge else None
    diffs = {"adapter_logits": 0.0, "merged_logits": 0.0}
    if dist.get_rank() == 0:
        want = _logits(reference)
        loaded = PeftModel.from_pretrained(tiny_model(family), adapter_dir)
        diffs["adapter_logits"] = (_logits(loaded) - want).abs().max().item()
        if merge:
            diffs["merged_logits"] = _merged_logits(merged_dir, want)
    dist.barrier()
    return diffs


def _merged_logits(merged_dir: Path, want: torch.Tensor) -> float:
    """The merged export loaded by plain transformers (no LoRA layer left): its logits' distance from ``want``."""
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in n or "base_layer" in n for n, _ in merged.named_parameters())
    return (_logits(merged) - want).abs().max().item()


def _errors_in_world(world_size: int) -> dict[str, str]:
    """Adapters tensor parallelism cannot split: refused on every rank before anything is split."""
    errors = {}
    configs = {
        "lm_head": LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "lm_head"]),
        "dora": LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"], use_dora=True),
        "modules_to_save": LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    }
    for key, config in configs.items():
        model = get_peft_model(tiny_model("llama"), config)
        try:
            parallelize(model, ParallelLayout(tp_size=world_size))
            errors[key] = ""
        except LayoutError as err:
            errors[key] = str(err)
    # The silently wrong order (adapters built on local shards) is refused.
    try:
        apply_lora(parallelize(tiny_model("llama"), ParallelLayout(tp_size=world_size)), LoraOptions())
        errors["lora_after_parallelize"] = ""
    except OptionsError as err:
        errors["lora_after_parallelize"] = str(err)
    return errors


def _full_export_under_pipeline(world_size: int, tmp: str) -> dict[str, object]:
    """``export_hf`` of a full model split into stages (tied embedding and head on different ranks)."""
    model = tiny_model("llama_tied_4l")
    reference = copy.deepcopy(model)
    parallelize(model, ParallelLayout(pp_size=world_size), ParallelOptions(pp_microbatches=2))
    out = export_hf(model, Path(tmp) / "pipeline-full")
    result: dict[str, object] = {}
    if dist.get_rank() == 0:
        loaded = AutoModelForCausalLM.from_pretrained(out)
        result["logits"] = (_logits(loaded) - _logits(reference)).abs().max().item()
        result["architectures"] = json.loads((out / "config.json").read_text())["architectures"]
    dist.barrier()
    return result


def _world(rank: int, world_size: int, out_dir: str) -> None:
    # DTensor warns once per mesh when it gathers a TP x FSDP2 weight in two steps (the checks here do).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = {name: _run_case(world_size, out_dir, name, *case) for name, case in CASES[world_size].items()}
    if world_size == 2:
        results["errors"] = _errors_in_world(world_size)
        results["pipeline_full_export"] = _full_export_under_pipeline(world_size, out_dir)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results(world_size: int) -> list[dict]:
    return world_json(_world, world_size)


@pytest.mark.parametrize("world_size,name", [(w, n) for w, cases in CASES.items() for n in cases], ids=str)
def test_lora_matches_one_process(world_size: int, name: str) -> None:
    per_rank = [results[name] for results in _results(world_size)]
    total = per_rank[0]["all_adapters"]
    for rank, diffs in enumerate(per_rank):
        where = (name, rank, diffs)
        assert diffs["adapter_change"] > 100 * TOL, where  # parity means something only if the adapters moved
        assert (diffs["router_change"] is not None) == diffs["router"], where
        if diffs["router"]:  # the router trained (its copy is compared with the adapters, to TOL)
            assert diffs["router_change"] > 10 * TOL, where  # clipped with the adapters: it moves ~3e-4 here
        if diffs["parity"]:
            assert diffs["loss_diff"] <= TOL and diffs["norm_diff"] <= TOL, where
            assert diffs["adapter_diff"] <= TOL, where
        else:  # dropout masks per data rank: training went elsewhere, but every tp group agrees
            assert diffs["adapter_diff"] > 100 * TOL, where
        assert diffs["tp_spread"] == 0.0 and diffs["unwaited_collectives"] == 0, where
        assert diffs["base_moved"] == 0.0, where
        # The optimizer holds exactly this rank's adapters, and has state for each of them.
        assert diffs["optimizer_params"] == diffs["optimizer_adapters"] == diffs["optimizer_state"] == diffs["adapters"]
        assert diffs["base_sharded"] == 1.0, where
        if "adapter_logits" in diffs:
            assert diffs["adapter_logits"] <= TOL and diffs["merged_logits"] <= TOL, where
    held = [diffs["adapters"] for diffs in per_rank]
    if per_rank[0]["pipeline"]:  # stages hold disjoint adapters (their own layers'), once per pipeline
        assert sum(held) == total * world_size // per_rank[0]["pp_size"], held
    else:
        assert held == [total] * world_size, held


def test_unsplittable_adapters_are_refused_under_tensor_parallelism() -> None:
    per_rank = [results["errors"] for results in _results(2)]
    assert all(errors == per_rank[0] for errors in per_rank), "every rank must raise the same error"
    errors = per_rank[0]
    assert "lm_head (Linear) is not one" in errors["lm_head"] and "q_proj" in errors["lm_head"], errors["lm_head"]
    assert "LoRA variant (e.g. DoRA)" in errors["dora"], errors["dora"]
    assert "modules_to_save" in errors["modules_to_save"], errors["modules_to_save"]
    assert "Apply LoRA first, then `lightning_plugins.parallelize`" in errors["lora_after_parallelize"], errors


# ------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"r": 0}, r"lora r=0 must be a positive integer"),
        ({"r": 2.5}, r"lora r=2.5 must be a positive integer"),
        ({"alpha": -1}, r"lora alpha=-1 must be a positive number"),
        ({"dropout": 1.0}, r"lora dropout=1.0 must be in \[0, 1\)"),
        ({"target_modules": []}, r"lora target_modules=\[\] must be a non-empty list"),
        ({"target_modules": ["q_proj", ""]}, r"must be a non-empty list of module names"),
        ({"quantize": "int4"}, r"lora quantize='int4' is not one of \('none', 'nf4'\)"),
        ({"autocast_adapter_dtype": "no"}, r"lora autocast_adapter_dtype='no' must be true or false"),
    ],
)
def test_bad_lora_options(settings: dict, match: str) -> None:
    with pytest.raises(OptionsError, match=match):
        LoraOptions(**settings)


def test_target_modules_naming_nothing_are_refused_naming_the_linears() -> None:
    with pytest.raises(OptionsError, match=r"target_modules \['qkv_proj'\] name no module of LlamaForCausalLM") as err:
        apply_lora(tiny_model("llama"), LoraOptions(target_modules=("q_proj", "qkv_proj")))
    assert "'down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj'" in str(err.value), err.value


def test_default_targets_are_the_projections_and_only_adapters_train() -> None:
    options = LoraOptions(target_modules=["q_proj", "v_proj"])
    assert options.target_modules == ("q_proj", "v_proj") and hash(options)  # a list becomes a tuple
    model = apply_lora(tiny_model("qwen3"), LoraOptions(r=RANK, alpha=ALPHA))
    adapted = {name.rpartition(".")[2] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trainable = trainable_parameters(model)
    assert len(trainable) == 2 * PROJECTIONS * 2 and all(p.requires_grad for p in trainable)
    names = {n for n, _ in model.named_parameters()}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n in names if "lora_" in n}
    with pytest.raises(OptionsError, match="already has LoRA adapters"):
        apply_lora(model, LoraOptions())


def test_full_model_export_collects_every_pipeline_stage() -> None:
    result = _results(2)[0]["pipeline_full_export"]
    assert result["logits"] <= TOL, result
    assert result["architectures"] == ["LlamaForCausalLM"], result  # not the pipelined subclass
