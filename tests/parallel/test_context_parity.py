"""Context parallelism through `parallelize` matches one process: per-step losses, grad norms, weights.

fp32, gloo, SGD with momentum (a wrong loss scale shows in the weights), gradient clipping exercised,
gradient accumulation over micro-batches with different numbers of valid tokens, right padding with
``-100`` labels, prompt tokens ignored, sequence lengths divisible and not divisible by ``2 * cp``.
Both backends at cp=2 (2 ranks) and cp=4, Qwen3.5's Gated DeltaNet linear attention (its kernel against the fp64
recurrence at cp = 1, 2, 4 in the 4-rank world, with test_linear_attention_context.py's helpers), sliding windows shorter than the sequence, soft-capping, sinks, CP x TP and CP x FSDP2 (4 ranks). Packed rows under CP train
exactly what one process trains on the unpacked samples (Qwen3.5's linear attention included, its packed kernel against
each document alone in fp64); left-padded rows what it trains on them as given.
One world per rank count checks every case (starting ranks is the slow part); each reference runs on one rank, which
broadcasts it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from _launch import world_json
from tiny_models import make_batch, tiny_model
from torch.distributed.tensor import DTensor

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.data.packing import collate_packed, pack_examples, prepare_model_for_packing
from lightning_plugins.parallel.options import with_settings
from lightning_plugins.parallel import clip_grad_norm_, context_parallel_batch, mesh_of

STEPS, ACCUM, BATCH, MAX_NORM, LR = 3, 2, 4, 0.5, 1.0
TOL = 1e-5

# name -> (family, sizes, seq, parallelize options)
U, R = {"cp_backend": "ulysses"}, {"cp_backend": "ring"}
CP2, CP4 = {"cp_size": 2}, {"cp_size": 4}
CASES = {
    2: {
        "llama cp2 ulysses seq16": ("llama", CP2, 16, U),
        "llama cp2 ring seq16": ("llama", CP2, 16, R),
        "llama cp2 ulysses seq13": ("llama", CP2, 13, U),
        "llama cp2 ring seq13 full-ac": ("llama", CP2, 13, {**R, "activation_checkpointing": "full"}),
        # The tiled MLP on this rank's shard of the tokens (tiles of 5, the last one short), checkpointed.
        "llama cp2 ring seq13 full-ac tiled-mlp": (
            "llama", CP2, 13, {**R, "activation_checkpointing": "full", "mlp_chunk_tokens": 5}
        ),
        # Ulysses runs the model's own attention implementation on the full sequence: eager here.
        "llama cp2 ulysses-eager seq13": ("llama", CP2, 13, {**U, "inner": "eager"}),
        "qwen3 cp2 ring seq15": ("qwen3", CP2, 15, R),
        "mistral cp2 ulysses seq15": ("mistral", CP2, 15, U),
        # The same samples packed two or three to a row (data.packing's first fit and collation).
        "llama cp2 ulysses seq16 packed": ("llama", CP2, 16, {**U, "data": "packed"}),
        "llama cp2 ring seq13 packed": ("llama", CP2, 13, {**R, "data": "packed"}),
        # Packed rows of 300 tokens: longer than one segment of the load-balanced layout (2 * cp * BALANCE_CHUNK).
        "llama cp2 ring seq150 packed": ("llama", CP2, 150, {**R, "data": "packed"}),
        "llama cp2 ulysses seq150 packed": ("llama", CP2, 150, {**U, "data": "packed"}),
        "llama cp2 ring seq16 left-padded": ("llama", CP2, 16, {**R, "data": "left"}),
        "llama cp2 ulysses seq13 left-padded": ("llama", CP2, 13, {**U, "data": "left"}),
        # Mixture of experts: the experts split over the two context ranks (EP is drawn from dp_shard x cp).
        "mixtral cp2 ep2 ring seq15": ("mixtral", {**CP2, "ep_size": 2}, 15, R),
        "qwen3_moe cp2 ulysses seq13": ("qwen3_moe", CP2, 13, U),
        # Sliding windows (8) shorter than the sequence, crossing the ranks' shards; Gemma 2's soft-capping and
        # query_pre_attn_scalar, Gemma 3's alternating local/global layers, gpt-oss's sinks on alternating windows.
        "mistral_sw cp2 ring seq20": ("mistral_sw", CP2, 20, R),
        "mistral_sw cp2 ulysses seq19": ("mistral_sw", CP2, 19, U),
        "gemma2 cp2 ring seq20": ("gemma2", CP2, 20, R),
        "gemma2 cp2 ring seq20 loss-chunk7": ("gemma2", CP2, 20, {**R, "loss_chunk_tokens": 7}),  # this rank's tokens
        "gemma2 cp2 ulysses seq20 packed": ("gemma2", CP2, 20, {**U, "data": "packed"}),
        "gemma3 cp2 ring seq18 packed": ("gemma3", CP2, 18, {**R, "data": "packed"}),
        "gpt_oss cp2 ring seq20": ("gpt_oss", CP2, 20, R),
        # Gated DeltaNet linear attention (two layers) before a full-attention one: heads split over cp (Ulysses), the
        # recurrent state and conv inputs passed along the ranks (ring). See test_linear_attention_context.py.
        "qwen3_5 cp2 ulysses seq13": ("qwen3_5", CP2, 13, U),
        "qwen3_5 cp2 ring seq13": ("qwen3_5", CP2, 13, R),
        # Packed rows: each document restarts the recurrent state and the conv, against the unpacked samples.
        "qwen3_5 cp2 ring seq13 packed": ("qwen3_5", CP2, 13, {**R, "data": "packed"}),
        "qwen3_5 cp2 ulysses seq16 packed": ("qwen3_5", CP2, 16, {**U, "data": "packed"}),
        # The same without CP: tp=2 with sequence parallelism, the documents cut inside the head split.
        "qwen3_5 tp2 seq13 packed": ("qwen3_5", {"tp_size": 2}, 13, {"data": "packed"}),
    },
    4: {
        "llama cp4 ulysses seq16": ("llama", CP4, 16, U),
        "llama cp4 ulysses seq21": ("llama", CP4, 21, U),
        "llama cp4 ring seq16": ("llama", CP4, 16, R),
        "llama cp4 ring seq21": ("llama", CP4, 21, R),
        "llama cp4 ring seq530": ("llama", CP4, 530, R),  # one segment of 2 * 4 * 64 tokens and a shorter one
        "llama cp2 x tp2 ulysses seq13": ("llama", {**CP2, "tp_size": 2}, 13, U),
        "llama cp2 x tp2 ring seq16": ("llama", {**CP2, "tp_size": 2}, 16, R),
        "llama cp2 x fsdp2 ulysses seq16": ("llama", {**CP2, "dp_shard_size": 2}, 16, U),
        "llama cp2 x fsdp2 ring seq13": ("llama", {**CP2, "dp_shard_size": 2}, 13, R),
        # Experts split over dp_shard x cp (2 x 2 = 4 ranks), or over the data ranks while cp x tp splits the rest.
        "qwen2_moe cp2 x fsdp2 ep4 ring seq15": ("qwen2_moe", {**CP2, "dp_shard_size": 2, "ep_size": 4}, 15, R),
        "mixtral cp2 x tp2 ep2 ulysses seq13": ("mixtral", {**CP2, "tp_size": 2, "ep_size": 2}, 13, U),
        # Gated DeltaNet under cp x tp: its heads split over tp, each tp rank's part context parallel inside the split
        # (the ring passes those heads' state along the cp ranks; Ulysses splits them over cp again).
        "qwen3_5 cp2 x tp2 ring seq13": ("qwen3_5", {**CP2, "tp_size": 2}, 13, R),
        "qwen3_5 cp2 x tp2 ring seq13 packed": ("qwen3_5", {**CP2, "tp_size": 2}, 13, {**R, "data": "packed"}),
        "qwen3_5_h4 cp2 x tp2 ulysses seq16 packed": ("qwen3_5_h4", {**CP2, "tp_size": 2}, 16, {**U, "data": "packed"}),
    },
}


def _batch(seq: int, vocab: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    # Rows of different valid lengths (right padding, -100 labels on pads and on the first tokens).
    return make_batch(BATCH, seq, vocab, seed=1000 * seq + 10 * step + micro)


def _left_padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each row's pads moved to its front (a generation-style batch); transformers counts positions from 0."""
    pads = (batch["attention_mask"] == 0).sum(-1)
    return {k: torch.stack([row.roll(int(n)) for row, n in zip(v, pads)]) for k, v in batch.items()}


def _packed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows' samples packed into rows of twice the length, as ``data.packing`` packs them."""
    samples = [
        {"input_ids": ids[mask.bool()].tolist(), "labels": labels[mask.bool()].tolist()}
        for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"])
    ]
    rows = pack_examples(samples, 2 * batch["input_ids"].shape[1])
    assert len(rows) < len(samples) and len(rows) % 2 == 0, "the test must pack several samples into a row"
    return collate_packed(rows, pad_token_id=0, max_seq_len=2 * batch["input_ids"].shape[1])


DATA = {"plain": lambda batch: batch, "left": _left_padded, "packed": _packed}


def _train(
    model: torch.nn.Module, seq: int, prepare, clip, data: str = "plain", max_norm: float = MAX_NORM
) -> list[float]:
    """STEPS optimizer steps of ACCUM micro-batches; returns per-step losses then pre-clip grad norms."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        step_loss = 0.0
        for micro in range(ACCUM):
            loss = model(**prepare(DATA[data](_batch(seq, model.config.vocab_size, step, micro)))).loss / ACCUM
            loss.backward()
            step_loss += loss.item()
        norm = clip(model.parameters(), max_norm)
        assert norm > max_norm, "the test must exercise clipping"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        norms.append(float(norm))
    return losses + norms


#: This rank's one-process references, by :func:`_reference_key` (filled by :func:`_share_references`).
_REFERENCES: dict[tuple, tuple[list[float], dict[str, torch.Tensor]]] = {}


def _reference(family: str, seq: int, data: str, max_norm: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    if (family, seq, data, max_norm) not in _REFERENCES:
        model = tiny_model(family)
        history = _train(model, seq, lambda batch: batch, torch.nn.utils.clip_grad_norm_, data, max_norm)
        _REFERENCES[family, seq, data, max_norm] = history, {n: p.detach().clone() for n, p in model.named_parameters()}
    return _REFERENCES[family, seq, data, max_norm]


def _reference_key(family: str, seq: int, options: dict) -> tuple[str, int, str, float]:
    """The one-process run a case is checked against: packed rows against the unpacked samples, left-padded rows
    against themselves; a mean over more tokens has a smaller gradient, so long sequences clip lower."""
    max_norm = MAX_NORM * 16 / seq if seq > 100 else MAX_NORM
    return family, seq, "left" if options.get("data") == "left" else "plain", max_norm


def _share_references(rank: int, world_size: int) -> None:
    """Each reference of the world's cases computed by one rank and broadcast: it does not depend on the rank."""
    import torch.distributed as dist

    keys = list(dict.fromkeys(_reference_key(c[0], c[2], c[3]) for c in CASES[world_size].values()))
    own = {key: _reference(*key) for index, key in enumerate(keys) if index % world_size == rank}  # all ranks at once
    for index, key in enumerate(keys):
        box = [own.get(key)]
        dist.broadcast_object_list(box, src=index % world_size)
        _REFERENCES[key] = box[0]


def _cp_prepare(model: torch.nn.Module):
    mesh = mesh_of(model)
    dp = mesh["dp"]

    def prepare(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows = len(batch["input_ids"]) // dp.size()
        local = slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)
        return context_parallel_batch({k: v[local] for k, v in batch.items()}, mesh)

    return prepare


def _run_case(world_size: int, family: str, sizes: dict, seq: int, options: dict) -> dict[str, float]:
    options = dict(options)
    inner = options.pop("inner", None)
    key = _reference_key(family, seq, options)
    ref_history, ref_weights = _reference(*key)
    data, max_norm = options.pop("data", "plain"), key[3]
    model = tiny_model(family)
    if inner is not None:
        model.set_attn_implementation(inner)
    if data == "packed" and sizes.get("cp_size", 1) == 1:  # without CP, packed rows need what the recipe does
        prepare_model_for_packing(model)
    model = parallelize(model, ParallelLayout(**sizes).resolve(world_size), *with_settings("test", **options))
    history = _train(model, seq, _cp_prepare(model), clip_grad_norm_, data, max_norm)
    weight_diff = 0.0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        weight_diff = max(weight_diff, (full.detach() - ref_weights[name]).abs().max().item())
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(history[:STEPS], ref_history[:STEPS])),
        "norm_diff": max(abs(a - b) for a, b in zip(history[STEPS:], ref_history[STEPS:])),
        "weight_diff": weight_diff,
        # How far the weights moved: a parity check is only meaningful if training changed them.
        "weight_change": max(
            (ref_weights[n] - p.detach()).abs().max().item() for n, p in tiny_model(family).named_parameters()
        ),
    }


def _world(rank: int, world_size: int, out_dir: str) -> None:
    from test_linear_attention_context import kernel_results

    _share_references(rank, world_size)
    results = {name: _run_case(world_size, *case) for name, case in CASES[world_size].items()}
    if world_size == 4:  # the linear-attention kernel under cp = 1, 2, 4 against the fp64 recurrence
        results.update(kernel_results(rank, world_size))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@functools.cache
def _results(world_size: int) -> dict[str, dict]:
    """Every case's differences, the worst over all ranks."""
    per_rank = world_json(_world, world_size)
    worst = {}
    for name, case in per_rank[0].items():
        worst[name] = {key: max(r[name][key] for r in per_rank) for key in case}
    return worst


@pytest.mark.parametrize(
    "world_size,name", [(w, name) for w, cases in CASES.items() for name in cases], ids=lambda x: str(x)
)
def test_context_parallel_matches_one_process(world_size: int, name: str) -> None:
    diffs = _results(world_size)[name]
    assert diffs["weight_change"] > 100 * TOL, diffs
    assert diffs["loss_diff"] <= TOL, (name, diffs)
    assert diffs["norm_diff"] <= TOL, (name, diffs)
    assert diffs["weight_diff"] <= TOL, (name, diffs)


def test_linear_attention_kernel_matches_recurrence() -> None:
    kernel = {name: diffs for name, diffs in _results(4).items() if name.startswith("linear-attention kernel")}
    # cp1, cp2: Ulysses seq24 and packed, ring seq24, seq520 and packed; cp4: ring
    assert len(kernel) == 13, sorted(kernel)
    for name, diffs in kernel.items():
        assert diffs["fp64"] < 1e-12 and diffs["a_log"] < 1e-6, (name, diffs)  # A_log's gradient: fp32's precision
