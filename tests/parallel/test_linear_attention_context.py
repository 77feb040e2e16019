"""Context parallelism for Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): exact against one process.

The default checks run inside ``test_context_parity``'s worlds (starting ranks is the slow part), with helpers from here:

* The kernel (its 4-rank world, :func:`kernel_results`): a Gated DeltaNet layer under cp = 1, 2 and 4 (process groups
  of the world), Ulysses (heads split over cp) and ring (state and conv inputs passed along the ranks in the
  load-balanced chunk order; sequences of one and of several load-balancing segments), against the single-sequence
  recurrence in fp64: outputs, the input's gradient and the parameters' gradients (``A_log``'s, which the module sums
  in fp32, to fp32's precision); packed rows (:data:`PACKED_ROWS`) against each document on its own. The module's
  own kernel is swapped for an fp64 recurrence there (the torch fallback computes in fp32): the wiring calls whatever
  kernel the model has.
* Training (its 2-rank world): the tiny Qwen3.5 (two linear-attention layers, then a full-attention one) under cp=2,
  Ulysses and ring, per-step losses, grad norms and final weights against one process (fp32); packed rows against one
  process on the unpacked samples.

Here: the refusals of layouts (before any collective) and, under ``-m slow``, the wider training matrix (Qwen3.5 MoE,
Qwen3-Next, activation checkpointing, rows over several load-balancing segments, EP x CP, packed rows)."""

from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_context_parity import TOL, _run_case
from tiny_models import CONFIGS

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.context.checks import check_context_parallel
from lightning_plugins.parallel.context.linear import apply_linear_context_parallel
from lightning_plugins.parallel.context.sharding import shard_sequence_load_balanced
from lightning_plugins.testing.world import run_world

U, R = {"cp_backend": "ulysses"}, {"cp_backend": "ring"}
CP2 = {"cp_size": 2}
SLOW_CASES = {
    "qwen3_5 cp2 ring seq16 full-ac": ("qwen3_5", CP2, 16, {**R, "activation_checkpointing": "full"}),
    "qwen3_5 cp2 ring seq150": ("qwen3_5", CP2, 150, R),  # rows of 300: two load-balancing segments
    "qwen3_5_moe cp2 ulysses seq13": ("qwen3_5_moe", CP2, 13, U),
    "qwen3_5_moe cp2 ep2 ring seq15": ("qwen3_5_moe", {**CP2, "ep_size": 2}, 15, R),
    "qwen3_next cp2 ring seq13": ("qwen3_next", CP2, 13, R),
    "qwen3_next cp2 ulysses seq16": ("qwen3_next", CP2, 16, U),
    # Packed rows of 300 tokens (documents across load-balancing segments), recomputed; the other families packed.
    "qwen3_5 cp2 ring seq150 packed full-ac": (
        "qwen3_5", CP2, 150, {**R, "data": "packed", "activation_checkpointing": "full"}
    ),
    "qwen3_5 cp2 ulysses seq150 packed": ("qwen3_5", CP2, 150, {**U, "data": "packed"}),
    "qwen3_5_moe cp2 ep2 ring seq15 packed": ("qwen3_5_moe", {**CP2, "ep_size": 2}, 15, {**R, "data": "packed"}),
    "qwen3_next cp2 ring seq13 packed": ("qwen3_next", CP2, 13, {**R, "data": "packed"}),
    "qwen3_next cp2 ulysses seq16 packed": ("qwen3_next", CP2, 16, {**U, "data": "packed"}),
}
#: CP x TP (4 ranks): the other families, recomputation, sequence parallelism off, rows over several segments.
SLOW_CASES_4 = {
    "qwen3_next cp2 x tp2 ring seq13 packed": ("qwen3_next", {**CP2, "tp_size": 2}, 13, {**R, "data": "packed"}),
    "qwen3_5_moe cp2 x tp2 ring seq15": ("qwen3_5_moe", {**CP2, "tp_size": 2}, 15, R),
    "qwen3_5 cp2 x tp2 ring seq13 no-sp full-ac": (
        "qwen3_5", {**CP2, "tp_size": 2}, 13, {**R, "sequence_parallel": False, "activation_checkpointing": "full"}
    ),
    "qwen3_5 cp2 x tp2 ring seq150 packed": ("qwen3_5", {**CP2, "tp_size": 2}, 150, {**R, "data": "packed"}),
    "qwen3_5_h4 cp2 x tp2 ulysses seq13": ("qwen3_5_h4", {**CP2, "tp_size": 2}, 13, U),
}
KERNEL_LENGTHS = (24, 520)  # one segment of the load-balanced layout; 520 > 2 * 4 * 64: several, the last one short


def _fp64_recurrence(query, key, value, g, beta, initial_state=None, output_final_state=False, **kwargs):
    """The gated delta rule token by token, in the inputs' dtype (transformers' recurrence without its fp32 cast)."""
    groups = value.shape[2] // key.shape[2]
    query, key = (x.repeat_interleave(groups, dim=2) for x in (query, key))
    query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    b, s, h, dk = key.shape
    state = initial_state if initial_state is not None else key.new_zeros(b, h, dk, value.shape[-1])
    outs = []
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        delta = (value[:, t] - (state * key[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        state = state + key[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * query[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1), state if output_final_state else None


class _Layer(torch.nn.Module):
    def __init__(self, linear_attn: torch.nn.Module) -> None:
        super().__init__()
        self.linear_attn = linear_attn

    def forward(self, hidden_states, position_ids=None):
        return self.linear_attn(hidden_states=hidden_states)


class _Mesh:
    def __init__(self, group) -> None:
        self.group = group

    def get_group(self):
        return self.group

    def size(self) -> int:
        return dist.get_world_size(self.group)


def _dyadic(x: torch.Tensor) -> torch.Tensor:
    """``x`` on a grid of 1/256: products and sums of such numbers are exact in fp64, whatever the summation order."""
    return (x * 256).round() / 256


def _gated_delta_net(family: str) -> torch.nn.Module:
    """Layer 0's Gated DeltaNet of the tiny ``family`` in fp64. The module computes its decay from ``in_proj_a``'s
    output cast to fp32 (``a.float()``): with dyadic weights (and inputs) that output is exact, so the fp32 rounding is
    the same for any split of the sequence and the comparison stays at fp64's precision."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float64).model.layers[0].linear_attn
    with torch.no_grad():
        module.in_proj_a.weight.copy_(_dyadic(module.in_proj_a.weight))
    return module


def _kernel_reference(family: str, seq: int) -> tuple[torch.Tensor, ...]:
    """One process's fp64 Gated DeltaNet on a random input: the input, the output's weights, the output, the input's
    gradient and the parameters' gradients."""
    config = CONFIGS[family]()
    reference = _gated_delta_net(family)
    x = _dyadic(torch.randn(2, seq, config.hidden_size, dtype=torch.float64)).requires_grad_()
    weights = torch.randn(2, seq, config.hidden_size, dtype=torch.float64)
    out = reference(x)
    (out * weights).sum().backward()
    return x.detach(), weights, out.detach(), x.grad, {name: p.grad.clone() for name, p in reference.named_parameters()}


def _kernel_case(family: str, group, backend: str, seq: int, references: dict | None = None) -> tuple[float, float]:
    """The largest difference of a cp Gated DeltaNet's output and gradients from one process's (fp64), and the relative
    difference of ``A_log``'s gradient. ``references``: :func:`_kernel_reference`'s results, kept for the next call."""
    references = {} if references is None else references
    if (family, seq) not in references:
        references[family, seq] = _kernel_reference(family, seq)
    x, weights, want_out, x_grad, want = references[family, seq]

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    layer = _Layer(_gated_delta_net(family))
    apply_linear_context_parallel(layer, 0, _Mesh(group), backend)
    local_x = shard_sequence_load_balanced(x.detach(), 1, rank, size).requires_grad_()
    positions = shard_sequence_load_balanced(torch.arange(seq).expand(2, seq), 1, rank, size)
    out = layer(local_x, position_ids=positions)
    (out * shard_sequence_load_balanced(weights, 1, rank, size)).sum().backward()
    diffs = [(out - shard_sequence_load_balanced(want_out, 1, rank, size)).abs().max()]
    diffs.append((local_x.grad - shard_sequence_load_balanced(x_grad, 1, rank, size)).abs().max())
    relative = 0.0
    for name, param in layer.linear_attn.named_parameters():
        dist.all_reduce(param.grad, group=group)  # each rank's part: its tokens (ring) or its heads (Ulysses)
        if name == "A_log":  # the module sums its gradient in fp32 (`A_log.float()`), over each run of tokens
            relative = float((param.grad - want[name]).abs().max() / want[name].abs().max())
        else:
            diffs.append((param.grad - want[name]).abs().max())
    return float(max(diffs)), relative


#: Packed rows of 40 tokens (documents' lengths): documents that begin inside a rank's run of positions and at its
#: first position (multiples of 10 for cp=2, of 5 for cp=4), documents shorter than the conv, a row of one document.
PACKED_ROWS = ((5, 8, 7, 1, 12, 7), (17, 23), (40,), (10, 20, 2, 8))


def _per_document(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The right answer for packed rows: each document through ``module`` on its own."""
    rows = []
    for row, lengths in enumerate(PACKED_ROWS):
        starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        rows.append(torch.cat([module(x[row : row + 1, lo:hi]) for lo, hi in itertools.pairwise(starts)], dim=1))
    return torch.cat(rows)


def _packed_reference(family: str) -> tuple[torch.Tensor, ...]:
    """:func:`_kernel_reference` for :data:`PACKED_ROWS`, each document through the module on its own."""
    config, seq = CONFIGS[family](), 40
    reference = _gated_delta_net(family)
    x = _dyadic(torch.randn(len(PACKED_ROWS), seq, config.hidden_size, dtype=torch.float64)).requires_grad_()
    weights = torch.randn(len(PACKED_ROWS), seq, config.hidden_size, dtype=torch.float64)
    out = _per_document(reference, x)
    (out * weights).sum().backward()
    return x.detach(), weights, out.detach(), x.grad, {name: p.grad.clone() for name, p in reference.named_parameters()}


def packed_kernel_case(family: str, group, backend: str, references: dict | None = None) -> tuple[float, float]:
    """As :func:`_kernel_case`, on :data:`PACKED_ROWS` against each document on its own; ``group=None``: one process
    (``prepare_linear_attention_for_packing``)."""
    from lightning_plugins.parallel.linear_documents import prepare_linear_attention_for_packing

    references = {} if references is None else references
    if (family, "packed") not in references:
        references[family, "packed"] = _packed_reference(family)
    x, weights, want_out, x_grad, want = references[family, "packed"]
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in PACKED_ROWS])
    size, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    shard = lambda t: shard_sequence_load_balanced(t, 1, rank, size)
    layer = _Layer(_gated_delta_net(family))
    if group is None:
        prepare_linear_attention_for_packing(layer)
    else:
        apply_linear_context_parallel(layer, 0, _Mesh(group), backend)
    local_x = shard(x.detach()).requires_grad_()
    out = layer(local_x, position_ids=shard(positions))
    (out * shard(weights)).sum().backward()
    diffs = [(out - shard(want_out)).abs().max(), (local_x.grad - shard(x_grad)).abs().max()]
    relative = 0.0
    for name, param in layer.linear_attn.named_parameters():
        if group is not None:
            dist.all_reduce(param.grad, group=group)
        if name == "A_log":
            relative = float((param.grad - want[name]).abs().max() / want[name].abs().max())
        else:
            diffs.append((param.grad - want[name]).abs().max())
    return float(max(diffs)), relative


def kernel_results(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    """:func:`_kernel_case` for cp = 1, 2 and 4 (groups of a 4-rank world), both backends (Ulysses up to cp=2: the tiny
    model has 2 key heads), one segment of the load-balanced layout and (ring) several, and packed rows
    (:func:`packed_kernel_case`); run in ``test_context_parity``'s 4-rank world. The module's kernel is swapped for the fp64 recurrence meanwhile."""
    with fp64_kernels():
        groups = {}
        for cp in (1, 2, 4):
            for first in range(0, world_size, cp):
                group = dist.new_group(list(range(first, first + cp)))
                if first <= rank < first + cp:
                    groups[cp] = group
        results, references = {}, {}  # the one-process references, the same at every cp
        for cp, group in groups.items():
            for backend, lengths in (("ulysses", KERNEL_LENGTHS[:1]), ("ring", KERNEL_LENGTHS)):
                if backend == "ulysses" and cp > 2:
                    continue
                for seq in lengths:
                    fp64, a_log = _kernel_case("qwen3_5", group, backend, seq, references)
                    results[f"linear-attention kernel cp{cp} {backend} seq{seq}"] = {"fp64": fp64, "a_log": a_log}
                fp64, a_log = packed_kernel_case("qwen3_5", group, backend, references)
                results[f"linear-attention kernel cp{cp} {backend} packed"] = {"fp64": fp64, "a_log": a_log}
        return results


@contextlib.contextmanager
def fp64_kernels() -> Iterator[None]:
    """Qwen3.5's Gated DeltaNet kernels swapped for :func:`_fp64_recurrence` (the torch fallback computes in fp32)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    kernels = modeling.torch_chunk_gated_delta_rule, modeling.torch_recurrent_gated_delta_rule
    modeling.torch_chunk_gated_delta_rule = modeling.torch_recurrent_gated_delta_rule = _fp64_recurrence
    try:
        yield
    finally:
        modeling.torch_chunk_gated_delta_rule, modeling.torch_recurrent_gated_delta_rule = kernels


def _parity_world(rank: int, world_size: int, out_dir: str, cases: dict) -> None:
    results = {name: _run_case(world_size, *case) for name, case in cases.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
@pytest.mark.parametrize("world_size,cases", [(2, SLOW_CASES), (4, SLOW_CASES_4)], ids=["cp2", "cp2xtp2"])
def test_linear_attention_context_parallel_wider_matrix(world_size: int, cases: dict) -> None:
    with tempfile.TemporaryDirectory() as out_dir:
        run_world(_parity_world, world_size, out_dir, cases)
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
    for name in cases:
        diffs = {key: max(r[name][key] for r in per_rank) for key in per_rank[0][name]}
        assert diffs["weight_change"] > 100 * TOL, (name, diffs)
        for key in ("loss_diff", "norm_diff", "weight_diff"):
            assert diffs[key] <= TOL, (name, diffs)


@pytest.mark.parametrize(
    "sizes,backend,match",
    [
        ({"cp_size": 2, "tp_size": 2}, "ulysses", r"linear_num_key_heads=1 \(2 / tp_size=2 per tensor-parallel rank"),
        ({"cp_size": 4}, "ulysses", "linear_num_key_heads=2"),
    ],
)
def test_linear_attention_context_parallel_refusals(sizes: dict, backend: str, match: str) -> None:
    config = CONFIGS["qwen3_5"]()
    with pytest.raises(LayoutError, match=match) as err:
        check_context_parallel(config, sizes["cp_size"], sizes.get("tp_size", 1), backend)
    assert "Decoder layer 0" in str(err.value) and "cp_size" in str(err.value)
