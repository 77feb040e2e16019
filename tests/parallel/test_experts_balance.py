"""The routing balance counters (one process): what they count, and what they leave out."""

from __future__ import annotations

import math

import torch
from tiny_models import make_batch, tiny_model

from lightning_plugins.parallel.moe.experts_balance import ExpertBalance


def test_counts_training_forwards_once_each() -> None:
    model = tiny_model("qwen2_moe")  # layer 1 is dense (mlp_only_layers): it routes nothing
    balance = ExpertBalance.of(model)
    assert balance is not None and ExpertBalance.of(tiny_model("llama")) is None
    batch = make_batch(4, 16, model.config.vocab_size, seed=0)
    model.train()
    model(**batch).loss.backward()
    plain = balance.read(reduce=False)
    counts = balance.last_counts
    tokens, k = 4 * 16, model.config.num_experts_per_tok
    assert counts[0].sum() == tokens * k and counts[1].sum() == 0
    assert plain["moe/load_max_over_mean"] == (counts[0].max() / counts[0].mean()).item()
    assert 0 < plain["moe/router_entropy"] <= math.log(k)
    # Activation checkpointing recomputes the forward inside backward: not counted twice. Evaluation is not counted.
    model.activation_checkpointing_enable({"use_reentrant": False})
    model(**batch).loss.backward()
    model.eval()
    with torch.no_grad():
        model(**batch)
    assert balance.read(reduce=False) == plain and torch.equal(balance.last_counts, counts)
    assert balance.read(reduce=False) == {}  # a window without training forwards
    balance.remove()
    model.train()
    model(**batch)
    assert balance.read(reduce=False) == {}
