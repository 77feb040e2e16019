"""Bad input fails early, before any collective, with a message naming the constraint and a fix."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from tiny_models import tiny_model
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from lightning_plugins import LayoutError, MemoryOptions, OptionsError, ParallelLayout, parallelize
from lightning_plugins.parallel.families import family_for


@pytest.fixture
def fake_world():
    """A fake process group of 8 ranks: parallelize runs its real code paths, no communication."""
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    yield 8
    dist.destroy_process_group()


def test_world_size_not_divisible() -> None:
    with pytest.raises(LayoutError, match=r"World size 6 is not divisible .* = 4 .*ParallelLayout\(tp_size=2"):
        ParallelLayout(tp_size=4).resolve(6)
    with pytest.raises(LayoutError, match="must equal the world size 8.*dp_shard_size=-1"):
        ParallelLayout(tp_size=2, dp_shard_size=2).resolve(8)


def test_sizes_must_be_positive() -> None:
    with pytest.raises(LayoutError, match="tp_size` must be a positive integer"):
        ParallelLayout(tp_size=0)
    with pytest.raises(LayoutError, match="dp_shard_size` must be a positive integer or -1"):
        ParallelLayout(dp_shard_size=-2)


@pytest.mark.parametrize(
    "config_kwargs,tp,constraint",
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 48}, 4, "num_attention_heads=6"),
        ({"num_attention_heads": 8, "num_key_value_heads": 2}, 4, "num_key_value_heads=2.*grouped-query"),
        ({"intermediate_size": 66}, 4, "intermediate_size=66"),
        ({"vocab_size": 66}, 4, "vocab_size=66"),
    ],
)
def test_tp_must_divide_the_model(config_kwargs: dict, tp: int, constraint: str) -> None:
    base = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 64}
    config = LlamaConfig(**{**base, **config_kwargs})
    layout = ParallelLayout(tp_size=tp).resolve(8)
    with pytest.raises(LayoutError, match=rf"tp_size=4 does not divide {constraint}.*valid tp_size values .*\[1, 2"):
        layout.validate(config)


def test_pp_larger_than_layers() -> None:
    with pytest.raises(LayoutError, match="pp_size=4 exceeds num_hidden_layers=2"):
        ParallelLayout(pp_size=4).resolve(4).validate(LlamaConfig(num_hidden_layers=2))


def test_layout_is_checked_before_any_collective(fake_world: int) -> None:
    model = tiny_model("llama")  # 2 kv heads
    with pytest.raises(LayoutError, match="num_key_value_heads=2"):
        parallelize(model, ParallelLayout(tp_size=4))
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_not_a_transformers_model(fake_world: int) -> None:
    with pytest.raises(LayoutError, match="not a transformers PreTrainedModel.*AutoModelForCausalLM"):
        parallelize(torch.nn.Linear(4, 4), ParallelLayout(tp_size=2))


def test_tp_on_a_model_without_a_plan(fake_world: int) -> None:
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64))
    with pytest.raises(LayoutError, match="'gpt2' has no registered family .* no `base_model_tp_plan`.*tp_size=1"):
        parallelize(gpt2, ParallelLayout(tp_size=2))
    # Without TP the same model is still data parallel (FSDP2 per block).
    assert family_for(gpt2, tensor_parallel=False).name == "gpt2"


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/store")
    yield
    dist.destroy_process_group()


def test_model_already_wrapped_in_ddp(one_rank: None) -> None:
    wrapped = torch.nn.parallel.DistributedDataParallel(tiny_model("llama"))
    with pytest.raises(LayoutError, match="already wrapped in DistributedDataParallel.*bare transformers model"):
        parallelize(wrapped, ParallelLayout())


def test_fsdp_options_need_data_ranks(one_rank: None) -> None:
    with pytest.raises(OptionsError, match="cpu_offload, param_dtype and reduce_dtype are FSDP2 options"):
        parallelize(tiny_model("llama"), ParallelLayout(), memory=MemoryOptions(cpu_offload=True))


def test_unknown_mixed_precision_dtype(fake_world: int) -> None:
    with pytest.raises(OptionsError, match="Unknown dtype param_dtype='fp8'.*bf16"):
        parallelize(tiny_model("llama"), ParallelLayout(tp_size=2), memory=MemoryOptions(param_dtype="fp8"))


def test_unknown_activation_checkpointing(fake_world: int) -> None:
    with pytest.raises(OptionsError, match="activation_checkpointing='some' is not one of"):
        parallelize(tiny_model("llama"), ParallelLayout(tp_size=2), memory=MemoryOptions(activation_checkpointing="some"))


def test_parallelize_needs_a_process_group() -> None:
    with pytest.raises(LayoutError, match="initialized process group"):
        parallelize(tiny_model("llama"), ParallelLayout())


def test_dry_run_on_a_fake_world(fake_world: int) -> None:
    """A meta-device model takes TP=2 x FSDP=4 on 8 fake ranks: local shapes are 1/8 of the weights."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    parallelize(model, ParallelLayout(tp_size=2))
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (64, 64) and q.to_local().shape == (8, 64)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_fallback_family_gets_sequence_parallel_from_its_structure() -> None:
    """An unregistered family gets its config's TP plan and, where its structure allows, sequence parallelism,
    without a word on the console; a parameter on the residual stream that is no norm leaves the stream replicated."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        olmo2 = family_for(tiny_model("olmo2"))
        gemma3 = family_for(tiny_model("gemma3"))
        gated = tiny_model("gemma")
        for layer in gated.model.layers:
            layer.residual_gate = torch.nn.Linear(32, 32)  # a learned gate between the regions: not per-token-norm
        blocked = family_for(gated)
    assert olmo2.sequence_parallel and olmo2.final_norm == "model.norm"
    # Post-norms only (no norm before attention), and q/k gathered for q_norm/k_norm over all heads.
    assert olmo2.layer_norms == ("post_attention_layernorm", "post_feedforward_layernorm")
    assert olmo2.extra_styles["self_attn.q_proj"] == "colwise_gather_output"
    assert set(olmo2.tp_regions) == {"self_attn", "mlp"}
    assert gemma3.layer_norms == (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
    )
    assert gemma3.head_norms == ("self_attn.q_norm", "self_attn.k_norm")
    assert blocked.colwise and blocked.rowwise and not blocked.sequence_parallel and not blocked.layer_norms


def test_model_already_wrapped_in_fsdp1(one_rank: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = FullyShardedDataParallel(tiny_model("llama"), device_id=torch.device("cpu"))
    with pytest.raises(LayoutError, match="already wrapped in FullyShardedDataParallel"):
        parallelize(wrapped, ParallelLayout())


@pytest.mark.parametrize(
    ("nodes", "sizes", "family", "message"),
    [
        (1, {"tp_size": 2}, "llama", "World size 1 is not divisible .* tp_size=2"),
        # Expert parallelism: ranks drawn from dp_shard x cp (here 2 nodes x 1 process), and a model with experts.
        (2, {"ep_size": 4}, "mixtral", r"ep_size=4 does not divide dp_shard_size x cp_size = 2 x 1 = 2.*in \[2\]"),
        (2, {"ep_size": 2}, "llama", "ep_size=2 .* this llama config declares none .* Use ep_size=1 for a dense model"),
    ],
)
def test_trainer_rejects_a_bad_layout_before_any_process_group(
    nodes: int, sizes: dict, family: str, message: str
) -> None:
    import lightning as L

    from lightning_plugins.demo import FineTune
    from lightning_plugins.strategies import ParallelismStrategy

    strategy = ParallelismStrategy(**sizes)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=nodes, strategy=strategy, logger=False)
    with pytest.raises(LayoutError, match=message):
        trainer.fit(FineTune(tiny_model(family), lr=1e-3), train_dataloaders=[])
    assert not dist.is_initialized()


def test_trainer_needs_an_hf_model_inside() -> None:
    import lightning as L

    from lightning_plugins.demo import FineTune
    from lightning_plugins.strategies import ParallelismStrategy

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ParallelismStrategy(), logger=False)
    with pytest.raises(LayoutError, match="found no transformers PreTrainedModel inside FineTune.*configure_model"):
        trainer.fit(FineTune(torch.nn.Linear(2, 2), lr=1e-3), train_dataloaders=[])


def _linear_attention_model(**overrides: object) -> torch.nn.Module:
    """A tiny Qwen3.5 text decoder on the meta device: a Gated DeltaNet ``linear_attn`` layer, then a full-attention
    one."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    sizes = {
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
        "intermediate_size": 64, **overrides,
    }  # fmt: skip
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**sizes))


def test_tensor_parallel_refuses_a_module_it_cannot_split_by_name(fake_world: int) -> None:
    """MiniMax's lightning attention (its linear-attention layers' ``self_attn``: a fused ``qkv_proj``, an output gate,
    a norm over all heads) has no tensor-parallel rule: refused by this project's error, naming the module and the
    dimension, before any collective (not torch's "got mixed torch.Tensor and DTensor")."""
    from transformers.models.minimax.configuration_minimax import MiniMaxConfig

    config = MiniMaxConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        LayoutError, match=r"tp_size=2: tensor parallelism cannot split model\.layers\.0\.self_attn \(MiniMaxLightning"
    ):
        parallelize(model, ParallelLayout(tp_size=2))
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_tensor_parallel_refuses_linear_attention_heads_it_cannot_divide(fake_world: int) -> None:
    """Qwen3.5's Gated DeltaNet is split by heads (test_linear_attention_parity.py): a tp_size that does not divide
    its key heads is refused, naming the module, before anything is split."""
    model = _linear_attention_model(num_key_value_heads=4)
    with pytest.raises(LayoutError, match=r"tp_size=4: .*model\.layers\.0\.linear_attn .*num_k_heads=2 is not divisible"):
        parallelize(model, ParallelLayout(tp_size=4))
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_tensor_parallel_splits_linear_attention_by_heads_on_a_fake_world(fake_world: int) -> None:
    """The dry run's path: Qwen3.5's Gated DeltaNet on the meta device, split by heads over tp=2 (its local head
    counts), every parameter a DTensor."""
    model = _linear_attention_model()
    parallelize(model, ParallelLayout(tp_size=2))
    linear = model.model.layers[0].linear_attn
    assert (linear.num_k_heads, linear.num_v_heads, linear.conv_dim) == (1, 2, 32)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
