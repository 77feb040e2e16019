"""The planner on mixture-of-experts models: active FLOPs, expert parallelism in the step time, the search and the
dry run.

Closed-form checks are derived here from the config's dimensions (not from the planner's own counts). The dry run is
checked on a tiny Qwen3-MoE (4 experts, top-2) over a fake world of 4: its state against the sharding EP implies,
and its measured step against the same step without expert parallelism (the all-to-all's dispatch and combine
buffers are the difference).
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from lightning_plugins import MemoryOptions, ParallelLayout, ParallelOptions
from lightning_plugins.planner.dryrun import dry_runs
from lightning_plugins.planner.hardware import cluster_from
from lightning_plugins.planner.model_stats import model_stats
from lightning_plugins.planner.search import candidate_workloads, estimate_peak
from lightning_plugins.planner.timing import estimate_step_time
from lightning_plugins.planner.workload import Workload

MIXED = MemoryOptions(activation_checkpointing="full", param_dtype="bf16")


def _config(name: str):
    return AutoConfig.from_pretrained(f"recipes/configs/{name}")


def test_moe_flops_count_the_active_experts_only() -> None:
    """Qwen3-30B-A3B: a token's matmuls are attention, the router and 8 of the 128 experts (SwiGLU, 3 matrices each),
    plus the head: ~3B, not the 30B the model holds."""
    c = _config("Qwen3-30B-A3B")
    d, h = c.head_dim, c.hidden_size
    attention = 2 * h * c.num_attention_heads * d + 2 * h * c.num_key_value_heads * d
    experts = c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
    expected = c.num_hidden_layers * (attention + experts) + c.vocab_size * h
    stats = model_stats(c)
    assert stats.matmul_params == expected
    assert stats.flops_per_token(4096) == 6 * expected + 12 * c.num_hidden_layers * c.num_attention_heads * d * 4096
    assert stats.total_params > 9 * stats.matmul_params  # the memory is the 30B's, the FLOPs a 3B's


def _step(name: str, gpus: int, **sizes: int):
    layout = ParallelLayout(**sizes).resolve(gpus)
    return estimate_step_time(
        name, layout, ParallelOptions(), MIXED, cluster_from("H100", gpus), seq_len=4096, micro_batch_size=1,
        global_batch_size=gpus,
    )  # fmt: skip


def test_expert_parallel_trades_expert_gathers_for_all_to_all_on_the_right_link() -> None:
    """EP over all of dp_shard leaves FSDP2 no expert weights to gather (its traffic drops to the dense part) and adds
    the all-to-all, exposed; an EP group that spans two nodes runs it over InfiniBand, ~7x slower per byte."""
    plain, ep8 = _step("Qwen3-30B-A3B", 8, dp_shard_size=8), _step("Qwen3-30B-A3B", 8, dp_shard_size=8, ep_size=8)
    assert plain.exposed_s["ep"] == 0 and ep8.exposed_s["ep"] > 0
    # Experts are 97% of Qwen3-30B-A3B's weights: the FSDP2 traffic falls by about that much.
    stats = model_stats("Qwen3-30B-A3B")
    dense = 1 - stats.num_layers * stats.expert_params / stats.total_params
    assert 0.5 * dense < plain.exposed_s["fsdp"] and ep8.exposed_s["fsdp"] < 2 * dense * plain.exposed_s["fsdp"]
    # Same bytes per rank ((e-1)/e of the rows leave it): 8 -> 16 ranks moves the group from NVLink to the NICs.
    inside, across = _step("Qwen3-30B-A3B", 16, dp_shard_size=16, ep_size=8), _step("Qwen3-30B-A3B", 16, dp_shard_size=16, ep_size=16)  # fmt: skip
    cluster = cluster_from("H100", 16)
    ratio = across.exposed_s["ep"] / inside.exposed_s["ep"]
    expected = (15 / 16) / (7 / 8) * cluster.intra_node / cluster.inter_node_bytes_per_s
    assert ratio == pytest.approx(expected, rel=1e-6)


def test_search_tries_expert_sizes_that_divide_the_experts_and_the_data_ranks() -> None:
    """Mixtral-8x22B has 8 experts: on 16 GPUs EP takes 1, 2, 4, 8 (not 16); a dense model gets EP 1 only."""
    lora = None
    seen = {w.layout.ep_size for w in candidate_workloads(_config("Mixtral-8x22B-v0.1"), cluster_from("H100", 16), 4096, 16, lora, "bf16")}  # fmt: skip
    assert seen == {1, 2, 4, 8}
    dense = {w.layout.ep_size for w in candidate_workloads(_config("Llama-3.1-8B"), cluster_from("H100", 8), 4096, 8, lora, "bf16")}  # fmt: skip
    assert dense == {1}


def test_screen_shards_experts_over_data_ranks_not_tensor_ranks() -> None:
    """Routed experts are replicated over TP (each TP rank runs its own tokens): TP=2 x FSDP=4 holds twice the expert
    state per GPU of FSDP=8, and the same dense state (8 ways either way). The screen's resident state (its estimate
    less the same workload's with CPU offload, which moves exactly that state to the host) says so."""
    config = _config("Qwen3-30B-A3B")

    def state(**sizes: int) -> int:
        layout = ParallelLayout(**sizes).resolve(8)
        work = Workload(config, layout, memory=MIXED, dtype="fp32", micro_batch_size=1)
        offloaded = Workload(config, layout, memory=MemoryOptions(activation_checkpointing="full", param_dtype="bf16", cpu_offload=True), dtype="fp32", micro_batch_size=1)  # fmt: skip
        return estimate_peak(work) - estimate_peak(offloaded)

    stats = model_stats(config)
    routed = stats.num_layers * stats.expert_params * 16  # bytes of fp32 weights, gradients and AdamW moments
    assert state(tp_size=2, dp_shard_size=4) - state(dp_shard_size=8) == pytest.approx(routed / 4 - routed / 8, rel=1e-9)
    assert state(dp_shard_size=8, ep_size=8) == state(dp_shard_size=8)  # EP moves experts, not their share


def _tiny_moe():
    from tiny_models import CONFIGS

    config = CONFIGS["qwen3_moe"]()
    config.num_hidden_layers = 2
    return config


def test_dry_run_of_an_expert_parallel_step_counts_its_shards_and_all_to_all() -> None:
    """A tiny Qwen3-MoE on a fake world of 4 (fp32, no checkpointing): with EP=2 each rank holds 2 of the 4 experts
    of every layer, FSDP2 shards those over the other 2 ranks and the rest over 4, so the counted state per rank is
    the same as without EP. The balanced router sends each rank's 2 x tokens rows out and back: an EP rank computes on
    as many rows as it would permute for its own experts without EP, so each interval of the step holds at least the
    activations without EP and at most the routed rows of every layer more (the dispatch and combine buffers take
    the local permutation's place; seen: equal, or one layer's rows more while the loss is computed)."""
    config = _tiny_moe()
    memory = MemoryOptions(activation_checkpointing="none")
    work = {
        ep: Workload(config, ParallelLayout(dp_shard_size=4, ep_size=ep).resolve(4), memory=memory, dtype="fp32",
                     seq_len=64, micro_batch_size=2)
        for ep in (1, 2)
    }  # fmt: skip
    plain, expert = (ranks[0] for ranks in dry_runs([work[1], work[2]]))
    stats = model_stats(config)
    assert stats.num_experts == 4 and stats.experts_per_token == 2
    assert plain.state["parameters"] == expert.state["parameters"] == pytest.approx(stats.total_params * 4 / 4, rel=0.02)
    one_layer = 2 * 64 * 2 * config.hidden_size * 4  # fp32 bytes of one layer's routed rows
    acts = [[interval["activations"] for interval in ranks.intervals] for ranks in (plain, expert)]
    assert max(acts[0]) >= config.num_hidden_layers * one_layer, (acts, one_layer)
    for without, with_ep in zip(*acts):
        assert without <= with_ep <= without + config.num_hidden_layers * one_layer, (acts, one_layer)
