"""Packed rows through Gated DeltaNet linear attention in one process: each document restarts the recurrent state and
the conv (``data.prepare_model_for_packing`` -> ``parallel.linear_documents``), as if trained alone.

transformers' torch kernels take no document boundaries, so without it a packed row carries one sample's state into
the next. Checked here in one process: the layer on :data:`~test_linear_attention_context.PACKED_ROWS` against each
document on its own in fp64 (outputs, the input's and the parameters' gradients), and training the tiny model on
packed rows against the same samples unpacked (per-step losses, pre-clip grad norms, final weights; fp32). The same
under context parallelism (ring and Ulysses) and tp=2 runs in ``test_context_parity``'s worlds.
"""

from __future__ import annotations

import pytest
import torch
from test_context_parity import MAX_NORM, STEPS, TOL, _reference, _train
from test_linear_attention_context import fp64_kernels, packed_kernel_case
from tiny_models import tiny_model

from lightning_plugins.data import prepare_model_for_packing


def test_one_process_packed_kernel_matches_each_document_alone() -> None:
    with fp64_kernels():
        fp64, a_log = packed_kernel_case("qwen3_5", None, "")
    assert fp64 < 1e-12 and a_log < 1e-6, (fp64, a_log)  # A_log's gradient: summed in fp32 by the module


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_5",
        pytest.param("qwen3_next", marks=pytest.mark.slow),
        pytest.param("qwen3_5_moe", marks=pytest.mark.slow),
    ],
)
def test_one_process_packed_training_matches_the_samples_unpacked(family: str) -> None:
    seq = 13
    ref_history, ref_weights = _reference(family, seq, "plain", MAX_NORM)
    model = tiny_model(family)
    prepare_model_for_packing(model)
    history = _train(model, seq, lambda batch: batch, torch.nn.utils.clip_grad_norm_, "packed", MAX_NORM)
    assert max(abs(a - b) for a, b in zip(history[:STEPS], ref_history[:STEPS])) <= TOL
    assert max(abs(a - b) for a, b in zip(history[STEPS:], ref_history[STEPS:])) <= TOL
    weight_change = max(
        (ref_weights[n] - p.detach()).abs().max().item() for n, p in tiny_model(family).named_parameters()
    )
    assert weight_change > 100 * TOL
    for name, param in model.named_parameters():
        assert (param.detach() - ref_weights[name]).abs().max().item() <= TOL, name
