"""Greedy generation of a parallelized model gives the one-process tokens (TP with and without sequence
and loss parallel, FSDP2, TP x FSDP2), on left-padded prompts as `generate` users batch them."""

from __future__ import annotations

import copy

import torch
from lightning_plugins.testing.world import run_world
from tiny_models import tiny_model

from lightning_plugins import ParallelLayout, ParallelOptions, parallelize

CASES = [
    ({"tp_size": 2, "dp_shard_size": 2}, ParallelOptions()),
    ({"tp_size": 2, "dp_shard_size": 2}, ParallelOptions(sequence_parallel=False, loss_parallel=False)),
    ({"tp_size": 2, "dp_shard_size": 2}, ParallelOptions(sequence_parallel=False)),
    ({"dp_shard_size": 4}, ParallelOptions()),
]


def _prompts(vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, vocab, (3, 7), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding
    attention_mask[2, :1] = 0
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}


def _generate(rank: int, world_size: int) -> None:
    reference = tiny_model("llama").eval()
    prompts = _prompts(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert expected.shape[-1] == 15
    for sizes, options in CASES:
        model = parallelize(copy.deepcopy(reference), ParallelLayout(**sizes), options).eval()
        with torch.no_grad():
            tokens = model.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert type(tokens) is torch.Tensor, (sizes, options, type(tokens))
        assert torch.equal(tokens, expected), (sizes, options, tokens, expected)


def test_greedy_generation_matches_one_process() -> None:
    run_world(_generate, 4)
