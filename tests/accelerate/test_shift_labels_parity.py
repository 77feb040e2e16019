"""A batch carrying ``shift_labels`` is trained on those targets under every layout, as transformers trains it.

Accelerate's ND-parallel example pre-shifts its targets and passes them as ``shift_labels`` and ``labels`` alike, then
runs the forward under ``accelerator.maybe_context_parallel(...)``. transformers' ``ForCausalLMLoss`` takes
``shift_labels`` as given and shifts ``labels`` only when there are none. Here that loop, unchanged but for
``ParallelAccelerator``, runs under context (ring and Ulysses), pipeline, tensor (loss parallel) and CP x PP layouts,
on rows of one sequence and on packed rows, and must match the same loop in one process (plain
``accelerate.Accelerator``): per-step losses and final weights, fp32, several steps. The chunked loss
(``loss_chunk_tokens``) takes the same targets.

Two kinds of batches: the example's (``labels`` equal to ``shift_labels``: a second shift would train each token on
the token after next) and one whose ``shift_labels`` are other targets than a one-step shift of ``labels`` (a layout
that shifted ``labels`` instead would train on the wrong targets).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning_plugins.testing.world import run_world
from tiny_models import tiny_model
from torch.distributed.tensor import DTensor

ROWS, BATCH, SEQ, LR, TOL = 16, 4, 16, 0.5, 1e-5
VOCAB = 64  # the tiny models' vocabulary
DOCS = (5, 11)  # packed rows: two documents, position ids restarting at 0 for the second


def _rows(data: str) -> list[dict[str, torch.Tensor]]:
    """The dataset: ``example`` (labels == shift_labels, both pre-shifted) or ``other`` (labels = input_ids,
    shift_labels other targets); ``packed`` adds position ids of two documents per row."""
    gen = torch.Generator().manual_seed(7)
    full = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=gen)
    input_ids = full[:, :-1]
    if data.startswith("example"):
        shift_labels = full[:, 1:].clone()
        labels = shift_labels
    else:
        labels = input_ids.clone()
        # Targets that are not the next token: what a one-step shift of `labels` would give is never one of them.
        shift_labels = (full[:, 1:] + torch.randint(1, VOCAB, (ROWS, SEQ), generator=gen)) % VOCAB
    shift_labels[:, :2] = -100  # an ignored prompt
    rows = []
    for i in range(ROWS):
        row = {"input_ids": input_ids[i], "labels": labels[i].clone(), "shift_labels": shift_labels[i].clone()}
        if data.endswith("packed"):
            row["position_ids"] = torch.cat([torch.arange(n) for n in DOCS])
            row["shift_labels"][DOCS[0] - 1] = -100  # a document's last token predicts nothing
        rows.append(row)
    assert not torch.equal(torch.stack([r["shift_labels"] for r in rows])[:, :-1], labels[:, 1:])
    return rows


def _unpacked(rows: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each packed row's documents as right-padded rows of their own: what one process trains packed rows as (under
    context parallelism attention stays within each document; one process's SDPA would attend across them)."""
    out = []
    for row in rows:
        start = 0
        for length in DOCS:
            piece = {k: v[start : start + length] for k, v in row.items() if k != "position_ids"}
            pad = SEQ - length
            out.append({
                "input_ids": torch.nn.functional.pad(piece["input_ids"], (0, pad)),
                "attention_mask": torch.nn.functional.pad(torch.ones(length, dtype=torch.long), (0, pad)),
                **{k: torch.nn.functional.pad(piece[k], (0, pad), value=-100) for k in ("labels", "shift_labels")},
            })  # fmt: skip
            start += length
    return out


def loop(accelerator: Any, data: str, one_process: bool = False) -> dict[str, Any]:
    """Accelerate's ND-parallel example loop: per-step losses and the final weights."""
    model = tiny_model("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    rows, batch_size = _rows(data), BATCH
    if one_process and data.endswith("packed"):
        rows, batch_size = _unpacked(rows), BATCH * len(DOCS)
    loader = torch.utils.data.DataLoader(rows, batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for batch in loader:
        buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"]]
        with accelerator.maybe_context_parallel(
            buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
        ):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    weights = {}
    for name, param in accelerator.unwrap_model(model).named_parameters():
        weights[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
    return {"loss": losses, "weights": weights}


def reference(datas: set[str]) -> dict[str, dict[str, Any]]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    results = {}
    try:
        for data in sorted(datas):
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            results[data] = loop(Accelerator(cpu=True), data, one_process=True)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    return results


def _run_cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]], expected: dict[str, Any]) -> None:
    import torch.distributed as dist

    from lightning_plugins.accelerate import ParallelAccelerator

    import logging

    warned: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("accelerate").addHandler(handler)
    for name, case in cases.items():
        case = dict(case)
        data = case.pop("data")
        got = loop(ParallelAccelerator(**case, cpu=True), data)
        # The engine shards the batches already: Accelerate's context is harmless, and says nothing misleading.
        assert not [m for m in warned if "Context parallel" in m], (name, warned)
        want = expected[data]
        shown = f"{name} loss: got {got['loss']} want {want['loss']}"
        torch.testing.assert_close(
            torch.tensor(got["loss"]), torch.tensor(want["loss"]), rtol=TOL, atol=TOL, msg=lambda m, s=shown: f"{s}\n{m}"
        )
        for param_name, weight in got["weights"].items():
            torch.testing.assert_close(weight, want["weights"][param_name], rtol=TOL, atol=TOL, msg=f"{name} {param_name}")
        seen = [None] * world_size
        dist.all_gather_object(seen, list(got["weights"]))
        assert set().union(*seen) == set(want["weights"]), f"{name}: some parameters are on no rank"


PP = {"pp_size": 2, "pp_schedule": "1f1b", "pp_microbatches": 2}
TWO_RANKS = {
    "cp2_ring_example": {"cp_size": 2, "cp_backend": "ring", "data": "example"},
    "cp2_ulysses_other": {"cp_size": 2, "cp_backend": "ulysses", "data": "other"},
    "cp2_ring_other_packed": {"cp_size": 2, "cp_backend": "ring", "data": "other_packed"},
    "pp2_example": {**PP, "data": "example"},
    "pp2_other": {**PP, "data": "other"},
    "tp2_loss_parallel_other": {"tp_size": 2, "data": "other"},
    "cp2_ring_chunked_loss_other": {"cp_size": 2, "cp_backend": "ring", "loss_chunk_tokens": 5, "data": "other"},
}
FOUR_RANKS = {
    "pp2_cp2_ulysses_other": {"pp_size": 2, "pp_microbatches": 2, "cp_size": 2, "cp_backend": "ulysses", "data": "other"},
    "pp2_cp2_ring_example_packed": {"pp_size": 2, "pp_microbatches": 2, "cp_size": 2, "cp_backend": "ring", "data": "example_packed"},
}


def test_shift_labels_are_the_targets_on_two_ranks() -> None:
    run_world(_run_cases, 2, TWO_RANKS, reference({c["data"] for c in TWO_RANKS.values()}))


def test_shift_labels_are_the_targets_under_cp_x_pp() -> None:
    run_world(_run_cases, 4, FOUR_RANKS, reference({c["data"] for c in FOUR_RANKS.values()}))


def test_the_engine_loss_reads_labels_as_transformers_does() -> None:
    """The engine's loss against transformers' ``ForCausalLMLoss``: ``shift_labels`` win over ``labels`` (a batch
    carrying both), ``labels`` alone are shifted once, and a custom ``ignore_index`` is ignored in either."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from lightning_plugins.parallel.loss import ParallelCausalLMLoss

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, VOCAB, generator=gen)
    labels = torch.randint(0, VOCAB, (2, 6), generator=gen)
    shift_labels = torch.randint(0, VOCAB, (2, 6), generator=gen)
    ours = ParallelCausalLMLoss()
    for ignore_index in (-100, -7):
        labels[0, :2], shift_labels[1, 3:] = ignore_index, ignore_index
        for kwargs in ({}, {"shift_labels": shift_labels}):
            want = ForCausalLMLoss(logits, labels, VOCAB, ignore_index=ignore_index, **kwargs)
            got = ours(logits, labels, VOCAB, ignore_index=ignore_index, **kwargs)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{kwargs.keys()} {ignore_index}")
