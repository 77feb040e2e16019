"""Packed preference pairs (``data.packing`` with a paired method): whole pairs per row, each sequence a document,
labels masked on prompts and at every document's start, the batch numbering each sequence as an unpacked batch
orders its rows; the log-probabilities, loss and metrics of a packed batch equal the unpacked batch's in one process.
Parity under FSDP2 and CP ring / Ulysses: tests/preference/test_dpo_parity.py ("packed" cases)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_batch, tiny_model
from transformers import AutoTokenizer

from lightning_plugins.data import DataConfig, DataError, build_dataset, make_collator
from lightning_plugins.data.packing import collate_packed_pairs, pack_pairs
from lightning_plugins.data.preference import ROW_PAIRS, fit_pair_to_length
from lightning_plugins.data.tiny import TINY_DIR
from lightning_plugins.parallel.context.batch import SEQUENCE_IDS, shard_batch_for_context_parallel
from lightning_plugins.preference import PreferenceObjective, PreferenceOptions, sequence_logps


def pairs_of(batch: dict[str, torch.Tensor]) -> list[dict[str, list[int]]]:
    """The pairs of an unpacked batch (chosen rows, then their rejected rows; right-padded) as data rows."""
    half = batch["input_ids"].shape[0] // 2
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    pairs = []
    for i in range(half):
        pair = {}
        for side, row in (("chosen", i), ("rejected", half + i)):
            pair[f"{side}_input_ids"] = batch["input_ids"][row, : lengths[row]].tolist()
            pair[f"{side}_labels"] = batch["labels"][row, : lengths[row]].tolist()
        pairs.append(pair)
    return pairs


def _pair(chosen: int, rejected: int, prompt: int = 2, start: int = 10) -> dict[str, list[int]]:
    pair = {}
    for side, length, offset in (("chosen", chosen, 0), ("rejected", rejected, 50)):
        ids = list(range(start + offset, start + offset + length))
        pair[f"{side}_input_ids"] = ids
        pair[f"{side}_labels"] = [-100] * prompt + ids[prompt:]
    return pair


def test_the_collator_packs_whole_pairs_as_documents() -> None:
    pairs = [_pair(5, 4, start=10), _pair(6, 6, start=100), _pair(3, 5, start=200), _pair(2, 2, 1, start=300)]
    rows = pack_pairs(pairs, max_seq_len=13)  # first fit: [p0, p3] (9 + 4), [p1] (12), [p2] (8)
    assert [len(row["input_ids"]) for row in rows] == [13, 12, 8]
    batch = collate_packed_pairs(rows, pad_token_id=0, max_seq_len=14)
    assert batch["input_ids"].shape == (3, 14) and "attention_mask" not in batch
    assert batch[ROW_PAIRS].tolist() == [2, 1, 1]
    # The batch's pairs, row by row: p0, p3 | p1 | p2; chosen of pair j is sequence j, its rejected 4 + j.
    order = [pairs[0], pairs[3], pairs[1], pairs[2]]
    ids, positions, labels, sequences = (batch[key] for key in ("input_ids", "position_ids", "labels", SEQUENCE_IDS))
    for j, pair in enumerate(order):
        for side, number in (("chosen", j), ("rejected", 4 + j)):
            where = (sequences == number).nonzero()
            rows_of = where[:, 0].unique()
            assert len(rows_of) == 1, (j, side)  # one sequence, one row
            row, columns = int(rows_of[0]), where[:, 1]
            assert columns.tolist() == list(range(int(columns[0]), int(columns[0]) + len(columns)))  # contiguous
            assert ids[row, columns].tolist() == pair[f"{side}_input_ids"]
            assert positions[row, columns].tolist() == list(range(len(columns)))  # a document: positions from 0
            want = [-100, *pair[f"{side}_labels"][1:]]  # the prompt masked, and the document's first token
            assert labels[row, columns].tolist() == want
        # a pair never split: its chosen and rejected sequences lie in the same row
        assert (sequences == j).nonzero()[0, 0] == (sequences == 4 + j).nonzero()[0, 0]
    # padding: no sequence, no label, positions of its own
    pad = sequences == -1
    assert pad.sum() == 3 * 14 - sum(len(r["input_ids"]) for r in rows)
    assert (labels[pad] == -100).all() and (ids[pad] == 0).all()
    assert positions[2, 8:].tolist() == list(range(6))


def test_a_pair_too_long_for_a_row() -> None:
    with pytest.raises(ValueError, match="sample 1 has 14 tokens, more than max_seq_len=13"):
        pack_pairs([_pair(3, 3), _pair(7, 7)], max_seq_len=13)
    config = DataConfig(train="x.jsonl", packing=True, max_seq_len=10, truncation="error")
    with pytest.raises(DataError, match="have 14 tokens together, more than data.max_seq_len=10"):
        fit_pair_to_length(_pair(7, 7), config)
    truncate = DataConfig(train="x.jsonl", packing=True, max_seq_len=10, truncation="truncate")
    cut = fit_pair_to_length(_pair(7, 7), truncate)
    assert [len(cut[f"{side}_input_ids"]) for side in ("chosen", "rejected")] == [5, 5]
    assert fit_pair_to_length(_pair(7, 3), config)["chosen_input_ids"] == _pair(7, 3)["chosen_input_ids"]  # fits whole


def test_context_parallel_shards_the_sequence_ids_with_the_tokens() -> None:
    rows = pack_pairs([_pair(5, 4), _pair(6, 6, start=100)], max_seq_len=21)
    batch = collate_packed_pairs(rows, pad_token_id=0, max_seq_len=21)
    shards = [shard_batch_for_context_parallel(batch, rank, 2) for rank in range(2)]
    for key, fill in (("input_ids", 0), (SEQUENCE_IDS, -1)):
        full = torch.nn.functional.pad(batch[key], (0, 3), value=fill)  # 21 tokens padded to a multiple of 4
        chunks = full.chunk(4, dim=1)  # load-balanced: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
        assert torch.equal(shards[0][key], torch.cat([chunks[0], chunks[3]], dim=1)), key
        assert torch.equal(shards[1][key], torch.cat([chunks[1], chunks[2]], dim=1)), key
    assert torch.equal(shards[0][ROW_PAIRS], batch[ROW_PAIRS])


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_packed_pairs_score_as_unpacked_in_one_process() -> None:
    """A plain model (one process, masked attention by document): each sequence's log-probability, the DPO loss and
    TRL's metrics of the packed batch equal the unpacked batch's; a wrong numbering would not."""
    model = tiny_model("llama")
    model.config.use_cache = False
    batch = make_batch(8, 13, model.config.vocab_size, seed=5)
    packed = collate_packed_pairs(pack_pairs(pairs_of(batch), 66), pad_token_id=0, max_seq_len=66)
    assert packed[ROW_PAIRS].tolist() == [3, 1]  # p0, p1, p3 | p2: the batch's order is not the pairs' order
    with torch.no_grad():
        want, got = sequence_logps(model, batch), sequence_logps(model, packed)
    order = torch.tensor([0, 1, 3, 2, 4, 5, 7, 6])  # the unpacked rows in the packed batch's sequence order
    for name in ("logps", "tokens", "logit_sums"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name)[order], rtol=0, atol=1e-5)
    # Not a loose check but a guard on the test itself: the packed order differs from the unpacked one, so the equality
    # above holds only through the sequence numbering (were the orders equal, a numbering ignored would pass too).
    assert not torch.allclose(got.logps, want.logps, atol=1e-3)
    objective = PreferenceObjective(PreferenceOptions(method="simpo", beta=0.5, sft_weight=0.3))  # no reference
    (loss, metrics), (packed_loss, packed_metrics) = objective(model, batch), objective(model, packed)
    torch.testing.assert_close(packed_loss, loss, rtol=0, atol=1e-5)
    assert packed_metrics.keys() == metrics.keys()
    for key in metrics:
        torch.testing.assert_close(packed_metrics[key], metrics[key], rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_DIR / "model")


def test_a_packed_preference_dataset(tmp_path: Path, tokenizer) -> None:
    """build_dataset with data.packing packs whole pairs (each pair's two sequences in one row) and make_collator
    numbers them; the trained tokens are the unpacked pairs' own."""
    records = [{"prompt": f"{'ab' * (i % 3 + 1)}=", "chosen": "ba" * (i % 2 + 1), "rejected": "a"} for i in range(7)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    base = dict(train=str(path), cache_dir=str(tmp_path / "cache"), max_seq_len=40)
    unpacked = build_dataset(DataConfig(**base), tokenizer, "train")
    packed = build_dataset(DataConfig(**base, packing=True), tokenizer, "train")
    assert len(packed) < len(unpacked) == 7
    batch = make_collator(DataConfig(**base, packing=True), tokenizer.pad_token_id)(list(packed))
    assert int(batch[ROW_PAIRS].sum()) == 7 and batch["input_ids"].shape[1] == 40
    seen = []
    for number in range(14):
        where = (batch[SEQUENCE_IDS] == number).nonzero()
        row, columns = int(where[0, 0]), where[:, 1]
        assert (where[:, 0] == row).all()  # one sequence, one row
        seen.append(_trained(batch["input_ids"][row, columns].tolist(), batch["labels"][row, columns].tolist()))
    assert all(seen)  # every sequence trains its completion, and the packed pairs train the unpacked pairs' tokens
    wanted = [_trained(pair[f"{side}_input_ids"], pair[f"{side}_labels"]) for side in ("chosen", "rejected")
              for pair in unpacked]  # fmt: skip
    assert sorted(seen) == sorted(wanted)
    assert seen[:7] != seen[7:]  # chosen and rejected sequences told apart


def _trained(ids: list[int], labels: list[int]) -> list[int]:
    return [i for i, label in zip(ids, labels) if label != -100]


def test_packed_pairs_are_refused_under_a_pipeline_by_name() -> None:
    """A pipeline's last stage scores whole rows: packed pairs are refused there (and by the recipe checks)."""
    from lightning_plugins.errors import OptionsError
    from lightning_plugins.parallel.pipeline.apply import _PIPELINE_ATTR

    model = tiny_model("llama")
    setattr(model.model, _PIPELINE_ATTR, object())  # what parallelize leaves on a model split into stages
    batch = collate_packed_pairs(pack_pairs([_pair(5, 4)], 13), pad_token_id=0, max_seq_len=13)
    objective = PreferenceObjective(PreferenceOptions(method="simpo", beta=0.5))
    with pytest.raises(OptionsError, match="Packed preference pairs .* do not run under pipeline parallelism yet"):
        objective(model, batch)
