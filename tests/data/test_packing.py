"""Packing is exact: a packed batch trains the same per-token loss as its samples padded, through the engine.

Reference: one process, the samples right-padded with an ``attention_mask``. Candidates: the same samples
packed (first fit into 64-token rows, positions restarting, no ``attention_mask``) in one process, under
TP=2 (with and without sequence/loss parallelism), under PP=2 and under CP=2 (Ulysses and ring), all in one
launched world of 2 ranks.
fp32, SGD with momentum, clipping that triggers, real chat data (only assistant tokens trained) plus
samples whose first token is a target (so the first-token masking of packed samples matters).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from lightning_plugins.testing.world import run_world
from tiny_models import tiny_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.masking_utils import find_packed_sequence_indices

from lightning_plugins import ParallelLayout, ParallelOptions, parallelize
from lightning_plugins.data import (
    IGNORE_INDEX,
    DataConfig,
    DataError,
    build_dataset,
    collate_causal_lm,
    collate_packed,
    load_prompt_completion,
    pack_examples,
    prepare_model_for_packing,
    read_jsonl,
    tiny_assets,
)
from lightning_plugins.parallel import clip_grad_norm_, context_parallel_batch, mesh_of, pipeline_of

STEPS, PER_STEP, MAX_LEN, MAX_NORM, LR = 3, 8, 64, 0.5, 0.5
# Packed and padded batches differ only in how each sample's tokens are laid out and in reduction orders:
# float32 rounding only. Absolute for losses, gradients and weights; relative for the gradient norm (~6,
# where one float32 ulp is ~5e-7 and TP sums the shards' squares in another order).
TOL = 1e-6


def _samples() -> list[dict[str, list[int]]]:
    """Chat samples (assistant turns trained) and prompt/completion samples trained on every token."""
    assets = tiny_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    chats = build_dataset(DataConfig(train=str(assets.chat_eval_file), max_seq_len=MAX_LEN), tokenizer, "train")
    plain = load_prompt_completion(read_jsonl(assets.eval_file)[: STEPS * PER_STEP // 4], tokenizer, MAX_LEN)
    plain = [{"input_ids": ex["input_ids"], "labels": list(ex["input_ids"])} for ex in plain]
    plain_iter, chat_iter = iter(plain), iter(chats)
    return [next(plain_iter) if i % 4 == 3 else next(chat_iter) for i in range(STEPS * PER_STEP)]


def _batches(rows_multiple: int = 1) -> tuple[list[dict], list[dict]]:
    """Per step: the padded batch and the packed batch of the same samples (rows padded to a multiple)."""
    samples = _samples()
    padded, packed = [], []
    for step in range(STEPS):
        group = samples[step * PER_STEP : (step + 1) * PER_STEP]
        padded.append(collate_causal_lm(group, pad_token_id=0))
        rows = pack_examples(group, MAX_LEN)
        rows += [{"input_ids": [], "labels": [], "position_ids": []}] * (-len(rows) % rows_multiple)
        packed.append(collate_packed(rows, pad_token_id=0, max_seq_len=MAX_LEN))
    return padded, packed


def _model(name: str = "tiny", attn: str = "sdpa") -> torch.nn.Module:
    if name == "tiny":
        model = AutoModelForCausalLM.from_pretrained(tiny_assets().model_dir, attn_implementation=attn)
    else:
        model = tiny_model(name)
        model.config._attn_implementation = attn
    prepare_model_for_packing(model)
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train(model: torch.nn.Module, batches: list[dict], *, parallel: bool = False) -> dict[str, Any]:
    """Steps of SGD with momentum and clipping; per-step losses and norms, first-step grads, final weights."""
    pipeline = pipeline_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model.train()
    losses, norms, grads = [], [], {}
    for step, batch in enumerate(batches):
        loss = model(**(context_parallel_batch(batch, mesh_of(model)) if parallel else batch)).loss
        if pipeline is None:
            loss.backward()
        if pipeline is not None:
            norm = pipeline.clip_grad_norm_(model.parameters(), MAX_NORM)
        elif parallel:
            norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        if step == 0:  # after clipping: scaled by the same global norm
            grads = {name: _full(p.grad).clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_full(loss.detach()).item())
        norms.append(_full(norm).item())
    weights = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": grads, "weights": weights}


def _assert_same(got: dict[str, Any], expected: dict[str, Any], where: str, tol: float = TOL) -> None:
    for key, atol, rtol in (("losses", tol, 0.0), ("norms", 0.0, tol)):
        torch.testing.assert_close(
            torch.tensor(got[key]), torch.tensor(expected[key]), atol=atol, rtol=rtol, msg=lambda m: f"{where} {key}: {m}"
        )
    for key in ("grads", "weights"):
        assert got[key].keys() <= expected[key].keys() and got[key], (where, key)
        for name, value in got[key].items():
            torch.testing.assert_close(value, expected[key][name], atol=tol, rtol=0, msg=lambda m: f"{where} {key} {name}: {m}")


def test_batches_are_really_packed() -> None:
    padded, packed = _batches()
    for pad, pack in zip(padded, packed):
        assert "attention_mask" not in pack
        assert pack["input_ids"].shape[0] < pad["input_ids"].shape[0]
        assert find_packed_sequence_indices(pack["position_ids"]) is not None  # transformers sees the boundaries
        targets = lambda labels: (labels[:, 1:] != IGNORE_INDEX).sum().item()  # noqa: E731
        assert targets(pack["labels"]) == targets(pad["labels"])
    # Some samples train their first token: without the -100 at each packed sample's start, the previous
    # sample's last token would learn to predict it.
    assert any(label != IGNORE_INDEX for s in _samples() for label in s["labels"][:1])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_padded_in_one_process(attn: str) -> None:
    padded, packed = _batches()
    torch.manual_seed(0)
    model = _model(attn=attn)
    reference = _train(copy.deepcopy(model), padded)
    _assert_same(_train(copy.deepcopy(model), packed), reference, f"one process, {attn}")

    # The test can fail: attention across samples (a KV cache disables transformers' packed detection),
    # or a packed sample's first token left as a target, changes the loss.
    crossing = copy.deepcopy(model)
    crossing.config.use_cache = True
    batch = packed[0]
    starts = (batch["position_ids"] == 0) & (batch["input_ids"] != 0)  # every packed sample's first token
    with torch.no_grad():
        crossed = crossing(**batch).loss.item()
        leaked = model(**dict(batch, labels=torch.where(starts, batch["input_ids"], batch["labels"]))).loss.item()
    assert abs(crossed - reference["losses"][0]) > 1e-3
    assert abs(leaked - reference["losses"][0]) > 1e-3


def test_prepare_model_for_packing() -> None:
    model = _model()
    model.config.use_cache = True
    prepare_model_for_packing(model)
    assert model.config.use_cache is False
    for implementation in ("flash_attention_2", "paged|sdpa"):
        model.config._attn_implementation = implementation
        with pytest.raises(DataError, match=rf"model uses '{re.escape(implementation)}'.*attn_implementation='sdpa'"):
            prepare_model_for_packing(model)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(DataError, match="only in a batch of one row.*varlen=True"):
        prepare_model_for_packing(model)
    # Given the samples' lengths flash attention keeps them apart, but on CUDA only: on CPU the fix is sdpa.
    with pytest.raises(DataError, match="CUDA only.*'cpu'.*attn_implementation='sdpa'"):
        prepare_model_for_packing(model, varlen=True)


def test_varlen_lengths_are_the_masked_paths_documents() -> None:
    """Flash attention's variable-length path attends within the spans ``cu_seq_lens`` gives over the batch's rows
    flattened. They are the documents the masked path (sdpa, transformers' block-diagonal mask) finds row by row, and
    a packed batch's loss is the loss of those spans each run alone (what the varlen kernel computes), on CPU."""
    _, packed = _batches()
    model = _model()
    for batch in packed[:1]:
        rows = [{"input_ids": ids, "labels": lab, "position_ids": pos} for ids, lab, pos in zip(
            batch["input_ids"].tolist(), batch["labels"].tolist(), batch["position_ids"].tolist())]  # fmt: skip
        varlen = collate_packed(rows, pad_token_id=0, max_seq_len=MAX_LEN, varlen=True)
        assert all(torch.equal(varlen[key], batch[key]) for key in batch)
        cu = varlen["cu_seq_lens_q"]
        assert cu.dtype == torch.int32 and torch.equal(cu, varlen["cu_seq_lens_k"])
        assert varlen["max_length_q"] == varlen["max_length_k"] == int(cu.diff().max())
        # The masked path's documents: find_packed_sequence_indices numbers them within each row.
        index = find_packed_sequence_indices(batch["position_ids"])
        offsets = torch.arange(index.shape[0])[:, None] * (int(index.max()) + 1)
        documents = torch.unique_consecutive((index + offsets).flatten(), return_counts=True)[1]
        assert torch.equal(cu.diff().long(), documents)
        # Loss: the packed batch through sdpa against each span of cu_seq_lens run alone, per token.
        with torch.no_grad():
            masked = model(**batch).loss
            ids, labels = batch["input_ids"].flatten(), batch["labels"].flatten()
            spans = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if (labels[a + 1 : b] >= 0).any()]
            total = sum(model(input_ids=ids[None, a:b], labels=labels[None, a:b]).loss * (labels[a + 1 : b] >= 0).sum()
                        for a, b in spans)  # fmt: skip
        assert abs(float(masked) - float(total) / int((batch["labels"][:, 1:] >= 0).sum())) <= TOL


def _check_parallel(rank: int, world_size: int) -> None:
    padded, packed = _batches(rows_multiple=2)  # PP splits each batch into 2 micro-batches
    pp = ParallelOptions(pp_schedule="1f1b", pp_microbatches=2)
    cases = [
        ("tiny", "TP=2 + SP + loss parallel", ParallelLayout(tp_size=2), ParallelOptions()),
        ("tiny", "TP=2", ParallelLayout(tp_size=2), ParallelOptions(sequence_parallel=False, loss_parallel=False)),
        ("tiny", "PP=2", ParallelLayout(pp_size=2), pp),
        ("mistral", "PP=2 (sliding-window masks)", ParallelLayout(pp_size=2), pp),
        ("tiny", "CP=2 ulysses", ParallelLayout(cp_size=2), ParallelOptions(cp_backend="ulysses")),
        ("tiny", "CP=2 ring", ParallelLayout(cp_size=2), ParallelOptions(cp_backend="ring")),
    ]
    references: dict[str, tuple] = {}
    for name, where, layout, options in cases:
        if name not in references:
            model0 = _model(name)
            references[name] = (model0, _train(copy.deepcopy(model0), padded))
        model0, reference = references[name]
        model = parallelize(copy.deepcopy(model0), layout, options)
        _assert_same(_train(model, packed, parallel=True), reference, f"{name} {where}")


def test_packed_equals_padded_under_tp_pp_and_cp() -> None:
    run_world(_check_parallel, 2)
