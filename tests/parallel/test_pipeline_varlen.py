"""Packed rows on flash attention's variable-length path under pipeline parallelism (issue 48): each stage finds its
micro-batch's sample lengths from the positions (``parallel.pipeline.stage.packed_lengths``), so the stages keep the
packed samples apart exactly as one process does with sdpa's block-diagonal mask.

flash-attn runs on CUDA only. Here ``flash_attention_2`` is, for the test's processes, a CPU function that does what
transformers' flash path does with what it is given (:func:`cpu_flash`): with ``cu_seq_lens_q`` each sample attends
within itself; without, every row is one causal sequence (flash finds packed samples from ``position_ids`` only in a
batch of one row), so a stage that did not pass the lengths would attend across the samples and fail the parity.
"""

from __future__ import annotations

import pytest
import test_pipeline_linear_attention
import test_pipeline_parity
import torch
from tiny_models import tiny_model
from transformers import AttentionInterface

from lightning_plugins.data.packing import prepare_model_for_packing, varlen_lengths
from lightning_plugins.testing.world import run_world

FLASH = "flash_attention_2"
packed_batch = test_pipeline_linear_attention.packed_batch
#: The default world: PP2 on a model whose layers attend within a sliding window (flash takes it with the lengths);
#: slow, full attention under both schedule kinds.
CASES = [("mistral_sw", {"pp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 4})]
SLOW_CASES = [
    ("llama_4l", {"pp_size": 2}, {"pp_schedule": "1f1b", "pp_microbatches": 2}),
    ("llama_4l", {"pp_size": 2}, {"pp_schedule": "interleaved_1f1b", "pp_microbatches": 2}),
]


def _spans(kwargs: dict, batch: int, seq: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of the flattened rows that attend within themselves."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # flash without lengths: each row is one causal sequence
        return [(row * seq, (row + 1) * seq) for row in range(batch)]
    assert int(cu[-1]) == batch * seq and kwargs["max_length_q"] == int(cu.diff().max())
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def cpu_flash(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
              softcap=None, **kwargs):  # fmt: skip
    """transformers' flash attention 2 (``integrations.flash_attention``) in plain torch, fp32 on CPU: ``query``
    ``[batch, heads, seq, dim]``, output ``[batch, seq, heads, dim]``; causal, GQA, sliding window, soft-cap."""
    assert attention_mask is None and dropout == 0.0, "packed rows carry no padding mask"
    batch, heads, seq, dim = query.shape
    flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value)]
    q, k, v = flat[0], *(t.repeat_interleave(heads // t.shape[1], dim=1) for t in flat[1:])
    out = torch.empty_like(q)
    for start, end in _spans(kwargs, batch, seq):
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) * (scaling or dim**-0.5)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(end - start)
        visible = pos[:, None] >= pos[None, :]
        if sliding_window is not None:
            visible &= pos[:, None] - pos[None, :] < sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v[start:end])
    return out.reshape(batch, seq, heads, dim), None


def _packed_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model prepared for packed rows as the recipes prepare it (no cache: the masked path finds the samples
    in the positions), attending with sdpa's block-diagonal masks (eager where it soft-caps)."""
    model = tiny_model(family, seed)
    model.config._attn_implementation = "eager" if model.config.model_type == "gemma2" else "sdpa"
    prepare_model_for_packing(model)
    return model


def _as_flash(model: torch.nn.Module) -> torch.nn.Module:
    """The model attending with flash attention 2 (built with sdpa: flash-attn is not installed here)."""
    model.config._attn_implementation = FLASH
    return model


def test_one_process_varlen_batch_matches_the_masked_path() -> None:
    """The collator's lengths make flash attention's loss sdpa's; without them it attends across the samples (what
    the pipeline test below would see from a stage that did not pass them)."""
    AttentionInterface.register(FLASH, cpu_flash)
    for family in ("llama", "mistral_sw", "gemma2_capped"):
        batch = packed_batch(4, 16, 64, seed=3)
        masked, flash = _packed_model(family), _as_flash(_packed_model(family))
        expected = masked(**batch).loss
        torch.testing.assert_close(flash(**batch, **varlen_lengths(batch["position_ids"])).loss, expected)
        assert (flash(**batch).loss - expected).abs() > 1e-3, family


def _flash_parallelize(parallelize):
    def parallelize_as_flash(model, *args, **kwargs):
        return parallelize(_as_flash(model), *args, **kwargs)  # the stages' copy; one process keeps sdpa's masks

    return parallelize_as_flash


def _check(rank: int, world_size: int, cases: list, steps: int) -> None:
    AttentionInterface.register(FLASH, cpu_flash)
    # This rank's process only: one process and the stages alike.
    test_pipeline_parity.make_batch, test_pipeline_parity.tiny_model = packed_batch, _packed_model
    test_pipeline_parity.parallelize = _flash_parallelize(test_pipeline_parity.parallelize)
    test_pipeline_parity._check_cases(rank, world_size, cases, steps)


def test_pipeline_stages_keep_packed_samples_apart_on_flash() -> None:
    run_world(_check, 2, CASES, 2)


@pytest.mark.slow
def test_pipeline_stages_keep_packed_samples_apart_on_flash_interleaved() -> None:
    run_world(_check, 2, SLOW_CASES, test_pipeline_parity.STEPS)
