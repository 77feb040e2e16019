"""The planner counts the host-memory levers: optimizer offload and activation offload (dry run, search, step time).

Expected bytes are derived here from the config's dimensions, not from the planner's counts: a Llama layer's
parameters as in ``test_planner_dryrun.py``; optimizer offload keeps, per trainable fp32 parameter, 16 bytes on
the host (a copy of the parameter, a gradient buffer, AdamW's two moments) and none of AdamW's 8 on the GPU; with
full checkpointing a layer saves only its input, ``batch x seq x hidden`` values, so activation offload moves
exactly that per layer to the host.
"""

from __future__ import annotations

import copy

import pytest
from transformers import LlamaConfig

from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions
from lightning_plugins.planner.dryrun import dry_run
from lightning_plugins.planner.rank_memory import with_optimizer_offload
from lightning_plugins.planner.hardware import cluster_from
from lightning_plugins.planner.model_stats import load_model_config
from lightning_plugins.planner.search import _memory_levers, estimate_peak
from lightning_plugins.planner.assumptions import HOST_ADAM_PARAMS_PER_S
from lightning_plugins.planner.timing import estimate_step_time
from lightning_plugins.planner.workload import Workload

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512}  # fmt: skip
LAYERS, SEQ, ROWS = 4, 256, 2


def _params(c: LlamaConfig) -> int:
    d = c.hidden_size // c.num_attention_heads
    q, kv, h = c.num_attention_heads * d, c.num_key_value_heads * d, c.hidden_size
    layer = 2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h
    return c.num_hidden_layers * layer + 2 * c.vocab_size * h + h


def _workload(memory: MemoryOptions, pp: int = 1) -> Workload:
    options = ParallelOptions(pp_microbatches=ROWS) if pp > 1 else ParallelOptions()
    layout = ParallelLayout(pp_size=pp).resolve(2 * pp)  # FSDP2 over 2 data ranks (per stage)
    config = LlamaConfig(num_hidden_layers=LAYERS, **SHAPE)
    return Workload(config, layout, options, memory, seq_len=SEQ, micro_batch_size=ROWS, dtype="fp32")


def test_dry_run_counts_each_lever() -> None:
    """One dry run per setting. Optimizer offload: AdamW's state leaves the GPU for the host, with the parameter
    copies and gradient buffers. Activation offload, measured: full checkpointing keeps each layer's input, which is
    exactly what moves; without checkpointing most of what the layers save moves; under a pipeline each stage moves
    its own layers' activations, for every micro-batch in flight."""
    settings = {
        "plain": ({}, 1),
        "optimizer": ({"optimizer_offload": True}, 1),
        "full": ({"activation_checkpointing": "full"}, 1),
        "full+activations": ({"activation_checkpointing": "full", "activation_offload": True}, 1),
        "activations": ({"activation_offload": True}, 1),
        "pp activations": ({"activation_offload": True}, 2),
    }
    # Full logits (loss_chunk_tokens=0) keep the step's peak at the end of forward, where every layer's saved
    # activations live: what the comparison of moved bytes with the plain step's activations below relies on.
    ranks = {
        name: dry_run(_workload(MemoryOptions(loss_chunk_tokens=0, **memory), pp=pp))
        for name, (memory, pp) in settings.items()
    }
    (plain,), (offloaded,), (full,), (full_offload,), (offload,) = (ranks[name] for name in list(settings)[:5])

    shard = _params(LlamaConfig(num_hidden_layers=LAYERS, **SHAPE)) / 2  # fp32, FSDP2 over 2 ranks
    assert plain.peak["optimizer"] == pytest.approx(8 * shard, rel=0.01) and plain.host == 0
    assert offloaded.peak["optimizer"] == 0
    assert offloaded.host == pytest.approx(16 * shard, rel=0.01)
    # Every interval loses the same state (the optimizer step also its temporaries): the peak falls at least by it.
    assert offloaded.total <= plain.total - plain.peak["optimizer"]
    assert any("optimizer offload modelled" in note for note in offloaded.notes)
    # The search applies the lever to a shared measurement of the plain workload: the same numbers.
    shared = copy.deepcopy(plain)
    with_optimizer_offload(shared)
    assert (shared.peak, shared.host) == (offloaded.peak, offloaded.host)

    assert full.host == 0
    assert full_offload.host == LAYERS * ROWS * SEQ * SHAPE["hidden_size"] * 4  # the layers' inputs, fp32
    assert full_offload.total < full.total
    assert offload.host > 0
    assert offload.peak["activations"] < plain.peak["activations"] / 2
    assert offload.total < plain.total
    # What moved is what the layers saved, not copies of more: no more than the plain step held as activations.
    assert offload.host <= plain.peak["activations"] * 1.1
    for rank in ranks["pp activations"]:
        assert rank.host > 0, rank.kind
        assert any("activation offload measured" in note for note in rank.notes)


def test_search_tries_optimizer_offload_where_cpu_offload_is_not_set() -> None:
    fsdp = ParallelLayout(dp_shard_size=8).resolve(8)
    levers = _memory_levers(fsdp, "fp32", "bf16")
    assert not any(m.cpu_offload and m.optimizer_offload for m in levers)
    assert {(m.cpu_offload, m.optimizer_offload) for m in levers} == {(False, False), (True, False), (False, True)}
    single = _memory_levers(ParallelLayout(tp_size=8).resolve(8), "bf16", "bf16")
    assert {(m.cpu_offload, m.optimizer_offload) for m in single} == {(False, False), (False, True)}
    # The closed-form screen drops AdamW's moments (2 x 4 bytes per fp32 parameter over 8 shards).
    config = load_model_config("Llama-3.1-8B")
    plain = Workload(config, fsdp, memory=MemoryOptions(param_dtype="bf16"), dtype="fp32", seq_len=4096)
    offloaded = Workload(config, fsdp, memory=MemoryOptions(param_dtype="bf16", optimizer_offload=True), dtype="fp32",
                         seq_len=4096)  # fmt: skip
    params = 8_030_261_248
    saved = estimate_peak(plain) - estimate_peak(offloaded)
    assert saved == pytest.approx(8 * params / 8, rel=1e-6)


def test_optimizer_offload_step_time_by_hand() -> None:
    # 8B, FSDP over 8 H100s with bf16 compute on fp32 masters: each rank sends its 1/8 of the fp32 gradients to the
    # host and gets the fp32 parameters back over 64 GB/s PCIe, and the host steps AdamW over them: all exposed.
    layout, cluster = ParallelLayout().resolve(8), cluster_from("H100", gpus=8)
    config = load_model_config("Llama-3.1-8B")

    def step(**memory):
        return estimate_step_time(config, layout, ParallelOptions(), MemoryOptions(param_dtype="bf16", **memory),
                                  cluster, seq_len=4096, micro_batch_size=1, global_batch_size=8)  # fmt: skip

    shard = 8_030_261_248 / 8
    expected = 2 * shard * 4 / cluster.gpu.pcie_bytes_per_s + shard / HOST_ADAM_PARAMS_PER_S
    offloaded, plain = step(optimizer_offload=True), step()
    assert offloaded.exposed_s["offload"] == pytest.approx(expected, rel=1e-9)
    assert offloaded.step_s - plain.step_s == pytest.approx(expected, rel=1e-9)
    assert any(line.startswith("optimizer offload:") for line in offloaded.assumptions)
