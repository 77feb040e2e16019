"""The plan counts each node's host memory: the load peak, offloaded state, the pinned allocator's rounding.

Expected bytes are derived here from the model config, not from the planner's counts: a Llama model's weight shapes
(as in ``test_planner_dryrun.py``); FSDP2 over ``n`` ranks gives rank 0 ``ceil(rows / n)`` rows of each weight (the
padded shard it allocates); CPU offload keeps 16 bytes per fp32 parameter on the host (weights, gradients, AdamW's
two moments), the weights and gradients pinned, each pinned allocation rounded up to a power of two by torch's host
allocator (AdamW adds a 4-byte step count per tensor); loading holds one tensor's local slice at a time, read in the
checkpoint's dtype (the config's) and cast to the weights' dtype.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from lightning_plugins import ParallelLayout
from lightning_plugins.adapters.lora import LoraOptions
from lightning_plugins.adapters.qlora import default_scaler_block_size, nf4_nbytes_for
from lightning_plugins.errors import RecipeError
from lightning_plugins.planner.dryrun import count_state
from lightning_plugins.planner.forked import forked
from lightning_plugins.planner.report import Plan, plan_recipe, recipe_cluster
from lightning_plugins.planner.workload import Workload
from lightning_plugins.recipe.schema import load_recipe

ROOT = Path(__file__).parents[2]
OFFLOAD = ROOT / "recipes" / "llama-3.1-70b" / "full_offload_8gpu.yaml"
QLORA_405B = ROOT / "recipes" / "llama-3.1-405b" / "qlora_1node.yaml"
GIB = 2**30


def _weights(c) -> list[tuple[int, int]]:
    """``(rows, columns)`` of every weight of a Llama model (a norm's ``hidden`` values as one column), as
    transformers stores them (an untied head)."""
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, q, kv, i = c.hidden_size, c.num_attention_heads * d, c.num_key_value_heads * d, c.intermediate_size
    layer = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h, 1), (h, 1)]
    return [(c.vocab_size, h)] + layer * c.num_hidden_layers + [(h, 1), (c.vocab_size, h)]


def _pow2_rounding(nbytes: int) -> int:
    power = 1
    while power < nbytes:
        power *= 2
    return power - nbytes


def _shard(rows: int, cols: int, ranks: int) -> int:
    """Values of rank 0's FSDP2 shard (dim 0, the padded size)."""
    return -(-rows // ranks) * cols


def _checkpoint_bytes(config) -> int:
    return torch.empty((), dtype=config.dtype).element_size()  # the checkpoint's dtype, as its config names it


@pytest.fixture(scope="module")
def offload_plan() -> Plan:
    """The 70B full fine-tune with CPU offload on one node of 8 x H100: one dry run for the module."""
    return plan_recipe(load_recipe(OFFLOAD))


def test_offload_recipe_host_memory_by_hand(offload_plan: Plan) -> None:
    plan = offload_plan
    config, ranks = plan.workload.config, plan.workload.world_size
    per_node = plan.cluster.gpus_per_node
    assert plan.workload.dtype == "fp32" and plan.workload.memory.cpu_offload and plan.cluster.nodes == 1
    weights = _weights(config)
    params = sum(rows * cols for rows, cols in weights)
    shards = [_shard(rows, cols, ranks) * 4 for rows, cols in weights]  # fp32 bytes of each weight on one rank
    rounding = sum(_pow2_rounding(nbytes) for nbytes in shards)
    host = plan.host

    # Training: 16 bytes per parameter over the node's ranks, the pinned weights and gradients rounded up.
    assert host.training["parameters"] == per_node * sum(shards) == pytest.approx(4 * params * per_node / ranks)
    assert host.training["gradients"] == per_node * sum(shards)
    steps = 4 * len(weights)  # AdamW's step count: an fp32 scalar per parameter tensor, next to its two moments
    assert host.training["optimizer"] == per_node * (2 * sum(shards) + steps)
    assert host.training["pinned rounding"] == 2 * per_node * rounding > 0
    assert sum(host.training.values()) == pytest.approx((16 * params / ranks) * per_node + 2 * per_node * rounding)

    # Loading: the pinned weights the slices are read into, and one tensor in flight: the largest local slice, read
    # in the checkpoint's dtype (cast to fp32 as it is copied into the shard).
    largest = max(_shard(rows, cols, ranks) for rows, cols in weights)
    in_flight = largest * _checkpoint_bytes(config)
    assert host.largest_read.numel == largest
    assert host.loading == {
        "in flight": per_node * in_flight,
        "parameters": per_node * sum(shards),
        "pinned rounding": per_node * rounding,
    }
    # The phases never coexist: the node's figure is the larger (training), not their sum.
    assert plan.host_per_node == sum(host.training.values()) < sum(host.training.values()) + sum(host.loading.values())
    assert plan.host_per_node <= plan.cluster.host_memory and plan.fits
    report = plan.describe()
    assert f"{plan.host_per_node / GIB:.1f} GiB per node against {plan.cluster.host_memory / GIB:.0f} GiB" in report
    assert "data: memory-mapped once per node, not counted" in report
    assert plan.as_dict()["host"]["per_node"] == plan.host_per_node


def test_a_recipe_over_its_node_memory_is_refused_with_the_numbers(offload_plan: Plan) -> None:
    """The recipe's hardware.host_memory_gb reaches the cluster the plan checks; under the figure, the plan does not
    fit and says by how much and what would help (the GPUs still fit)."""
    below = int(offload_plan.host_per_node / GIB) - 1
    recipe = load_recipe(OFFLOAD, [f"hardware.host_memory_gb={below}"])
    cluster = recipe_cluster(recipe)
    assert cluster.host_memory == below * GIB
    small = Plan(offload_plan.workload, cluster, offload_plan.ranks, offload_plan.step, offload_plan.margin)
    assert small.gpu_fits and not small.fits
    report = small.describe()
    assert f"DOES NOT FIT: peak {small.peak / GIB:.1f} GiB" in report
    assert f"host {small.host_per_node / GIB:.1f} GiB per node against {below} GiB" in report
    assert f"Host memory DOES NOT FIT: {small.host_per_node / GIB:.1f} GiB per node against {below} GiB" in report
    advice = small.advice()
    assert any(line.startswith("hardware.nodes: 2 with layout.dp_shard_size: 16") for line in advice), advice
    assert any(line.startswith("hardware.host_memory_gb") for line in advice), advice
    assert small.as_dict()["host"]["fits"] is False
    with pytest.raises(RecipeError, match="hardware.host_memory_gb"):
        load_recipe(OFFLOAD, ["hardware.host_memory_gb=-1"])


def test_405b_qlora_one_node_loads_one_slice_at_a_time() -> None:
    """Each of the 8 ranks reads its eighth of the largest tensor (the embedding, not quantized) in the checkpoint's
    bf16, the model's dtype too: the node holds the embedding's bytes once at the load peak. Counted on a copy with two
    of its decoder layers (the same tensors, fewer of them: seconds instead of half a minute of NF4 shapes)."""
    workload = Workload.from_recipe(load_recipe(QLORA_405B)).with_layers(2)
    config = workload.config
    [state] = forked([(count_state, (workload, 0))])
    read = state["largest_read"]
    assert read.name.endswith("embed_tokens.weight")
    assert read.numel == config.vocab_size * config.hidden_size // workload.world_size
    assert read.nbytes == read.numel * _checkpoint_bytes(config)
    # No offload: the loading phase is the node's figure, far under the 2 TiB of an 8 x H100 node.
    node = read.nbytes * 8
    assert node == config.vocab_size * config.hidden_size * _checkpoint_bytes(config)
    cluster = recipe_cluster(load_recipe(QLORA_405B))
    assert node < cluster.host_memory == 8 * cluster.gpu.host_bytes_per_gpu


def test_qlora_in_flight_holds_the_slice_and_its_nf4() -> None:
    """With a small vocabulary the MLP's weights are the largest: rank 0 reads its half of the rows in bf16 and holds
    their NF4 next to them."""
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=512, num_hidden_layers=2, dtype="bfloat16")  # fmt: skip
    workload = Workload(config, ParallelLayout().resolve(2), lora=LoraOptions(r=8, quantize="nf4"), dtype="bf16")
    [state] = forked([(count_state, (workload, 0))])
    read = state["largest_read"]
    rows, cols = config.intermediate_size, config.hidden_size
    local = rows // 2 * cols
    scaler = default_scaler_block_size((rows, cols))
    assert read.name.endswith(("gate_proj.base_layer.weight", "up_proj.base_layer.weight"))
    assert read.numel == local
    assert read.nbytes == local * 2 + nf4_nbytes_for(local, scaler_block_size=scaler)
    assert "NF4" in read.how


def test_host_memory_defaults_to_the_gpus_node_and_the_recipe_overrides_it() -> None:
    recipe = load_recipe(OFFLOAD)
    default = recipe_cluster(recipe)
    assert default.host_memory == default.gpus_per_node * default.gpu.host_bytes_per_gpu
    assert "hardware.host_memory_gb" in default.host_memory_source
    hardware = recipe.hardware.model_copy(update={"host_memory_gb": 1536})
    given = recipe_cluster(recipe.model_copy(update={"hardware": hardware}))
    assert given.host_memory == 1536 * GIB
    assert recipe_cluster(recipe, host_memory="1TiB").host_memory == 2**40
