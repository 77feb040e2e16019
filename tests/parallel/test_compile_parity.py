"""``compile=True`` (``torch.compile`` per decoder layer) trains exactly as eager: plain, FSDP2=2, with full AC (fp32, gloo).

The parallel cases reuse :func:`test_parallel_parity._check_cases` (per-step losses, pre-clip gradient norms and final
weights against one eager process, STEPS (3) steps of SGD with momentum, clipping and accumulation); the plain case
compiles a one-process model the same way. Each case asserts that the layers were compiled (a lever that did nothing
could not pass). The refusals (TP on CPU, GPU-only levers) are in ``test_compile_errors.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from lightning_plugins.testing.world import run_world
from test_parallel_parity import STEPS, TOL, _check_cases, _train
from tiny_models import tiny_model

from lightning_plugins.parallel import api
from lightning_plugins.parallel.compile import apply_compile

COMPILE = {"compile": True}
CASES = [
    ("llama", {"dp_shard_size": 2}, COMPILE),
    ("llama", {"dp_shard_size": 2}, {**COMPILE, "activation_checkpointing": "full"}),
]


def test_compiled_layers_match_eager_in_one_process() -> None:
    eager = tiny_model("llama")
    compiled = copy.deepcopy(eager)
    apply_compile(compiled.model.layers)
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    want = _train(eager, slice(None), torch.nn.utils.clip_grad_norm_)
    got = _train(compiled, slice(None), torch.nn.utils.clip_grad_norm_)
    assert len(got) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOL, rtol=0)
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0, msg=lambda m: f"{name}: {m}")


def _check_compiled(rank: int, world_size: int, cases: list, tmp: str) -> None:
    """:func:`_check_cases`, counting the layers ``parallelize`` compiled (patched in on each rank)."""
    compiled: list[int] = []

    def counted(layers) -> None:
        apply_compile(layers)
        compiled.append(sum(layer._compiled_call_impl is not None for layer in layers))

    api.apply_compile = counted  # where parallelize looks it up
    _check_cases(rank, world_size, cases, tmp)
    assert compiled == [2] * len(cases), compiled  # the tiny llama's two layers, in every case


def test_compiled_layers_match_one_process_under_fsdp2(tmp_path: Path) -> None:
    run_world(_check_compiled, 2, CASES, str(tmp_path))
