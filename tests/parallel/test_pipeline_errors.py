"""Bad pipeline input fails early, before any collective, with a message naming the constraint and a fix.

A batch that does not split into the micro-batches is checked in the launched world of
tests/parallel/test_pipeline_parity.py (it needs a built pipeline).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tiny_models import tiny_model
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_plugins import LayoutError, MemoryOptions, OptionsError, ParallelLayout, ParallelOptions, parallelize
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.parallel.pipeline import PipelineOptions, layer_ranges, stages_of_rank
from lightning_plugins.strategies import ParallelismStrategy, PipelineParallelStrategy


@pytest.fixture
def fake_world():
    """A fake process group of 4 ranks: parallelize runs its real validation, no communication."""
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    yield 4
    dist.destroy_process_group()


def test_unknown_schedule(fake_world: int) -> None:
    with pytest.raises(OptionsError, match=r"pp_schedule='zero_bubble' is not a known pipeline schedule\. Use one of"):
        parallelize(tiny_model("llama_4l"), ParallelLayout(pp_size=2), ParallelOptions(pp_schedule="zero_bubble"))


def test_pp_larger_than_layers(fake_world: int) -> None:
    with pytest.raises(LayoutError, match="pp_size=4 exceeds num_hidden_layers=2.*pp_size <= 2"):
        parallelize(tiny_model("llama"), ParallelLayout(pp_size=4))


def test_interleaved_with_too_few_layers(fake_world: int) -> None:
    # 4 ranks x 2 stages = 8 stages, but only 4 layers.
    with pytest.raises(LayoutError, match=r"= 8 pipeline stages, but the model has only num_hidden_layers=4.*'1f1b'"):
        parallelize(tiny_model("llama_4l"), ParallelLayout(pp_size=4), ParallelOptions(pp_schedule="interleaved_1f1b"))
    with pytest.raises(LayoutError, match="= 6 pipeline stages.*num_hidden_layers=4. .*pp_stages_per_rank=2"):
        PipelineOptions("interleaved_1f1b", stages_per_rank=3).resolve(2, num_layers=4)


def test_fewer_microbatches_than_stages_for_1f1b() -> None:
    with pytest.raises(OptionsError, match=r"'1f1b' needs at least as many micro-batches as pipeline stages: .*2 < 4"):
        PipelineOptions("1f1b", microbatches=2).resolve(4)


def test_interleaved_microbatches_not_a_multiple_of_pp() -> None:
    with pytest.raises(OptionsError, match=r"rounds of pp_size=4: pp_microbatches=6 must be a positive multiple of 4"):
        PipelineOptions("interleaved_1f1b", microbatches=6).resolve(4)


def test_microbatches_must_be_positive() -> None:
    with pytest.raises(OptionsError, match="pp_microbatches must be a positive integer, got 0"):
        PipelineOptions("gpipe", microbatches=0).resolve(2)


def test_stages_per_rank_must_fit_the_schedule() -> None:
    with pytest.raises(OptionsError, match="'1f1b' runs one stage per rank.*interleaved_1f1b"):
        PipelineOptions("1f1b", stages_per_rank=2).resolve(2)
    with pytest.raises(OptionsError, match="'zbv_zero_bubble' is V-shaped and needs exactly 2 stages per rank"):
        PipelineOptions("zbv_zero_bubble", stages_per_rank=3).resolve(2)
    with pytest.raises(OptionsError, match="'interleaved_1f1b' interleaves several stages per rank.*>= 2"):
        PipelineOptions("interleaved_1f1b", stages_per_rank=1).resolve(2)


def test_pipeline_with_context_parallel_checks_the_attention(fake_world: int) -> None:
    """PP x CP composes (parity in test_pipeline_parity.py); the context-parallel checks still apply to it."""
    model = tiny_model("llama_4l")
    model.config.attention_dropout = 0.1
    with pytest.raises(OptionsError, match="Ring attention has no attention dropout.*backend='ulysses'"):
        parallelize(model, ParallelLayout(pp_size=2, cp_size=2), ParallelOptions(cp_backend="ring"))


@pytest.mark.parametrize("layout", [ParallelLayout(pp_size=2), ParallelLayout(pp_size=2, cp_size=2)], ids=["dp", "cp"])
def test_tied_embedding_on_one_rank_with_fsdp(fake_world: int, layout: ParallelLayout) -> None:
    # FSDP2 shards each stage over the data ranks, and over the context-parallel ranks too.
    with pytest.raises(OptionsError, match="tied embedding.*two FSDP2 stage modules.*interleaved_1f1b"):
        parallelize(
            tiny_model("llama_tied_4l"), layout, ParallelOptions(pp_schedule="zbv_zero_bubble", pp_microbatches=2)
        )


def test_strategy_refuses_bad_options_at_construction() -> None:
    with pytest.raises(OptionsError, match="pp_schedule='bogus' is not a known pipeline schedule"):
        PipelineParallelStrategy(pp_size=2, pp_schedule="bogus")
    with pytest.raises(LayoutError, match="pp_size must be an integer >= 2.*ParallelismStrategy"):
        PipelineParallelStrategy(pp_size=1)
    with pytest.raises(LayoutError, match="sharded \\(DCP\\) checkpoints only"):
        PipelineParallelStrategy(pp_size=2, save_distributed_checkpoint=False)
    with pytest.raises(LayoutError, match="ParallelismStrategy writes sharded \\(DCP\\) checkpoints only"):
        ParallelismStrategy(pp_size=2, tp_size=2, save_distributed_checkpoint=False)
    with pytest.raises(OptionsError, match="PipelineParallelStrategy got unknown setting\\(s\\) \\['schedule'\\]"):
        PipelineParallelStrategy(pp_size=2, schedule="gpipe")


def test_stage_placement_and_layer_split() -> None:
    looped = PipelineOptions("interleaved_1f1b").resolve(2, num_layers=8)
    assert stages_of_rank(0, 2, looped) == [0, 2] and stages_of_rank(1, 2, looped) == [1, 3]
    v_shape = PipelineOptions("zbv_zero_bubble").resolve(2, num_layers=8)
    assert stages_of_rank(0, 2, v_shape) == [0, 3] and stages_of_rank(1, 2, v_shape) == [1, 2]
    assert [list(r) for r in layer_ranges(5, 3)] == [[0, 1], [2, 3], [4]]  # the last stage also runs the head
    assert PipelineOptions("1f1b").resolve(4).microbatches == 4  # default: one micro-batch per stage


def test_forward_a_stage_cannot_reproduce(fake_world: int) -> None:
    """Real transformers decoders whose forward does more than a stage runs are refused, naming what blocks them."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Llama4TextConfig, PhiConfig

    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 64}
    # Phi (Phi-2): dropout on the embeddings and a `final_layernorm` where stages run `norm`.
    phi = AutoModelForCausalLM.from_config(PhiConfig(**small, num_hidden_layers=2))
    with pytest.raises(LayoutError, match=r"model_type 'phi': its forward runs \['model.embed_dropout', 'model.final_"):
        parallelize(phi, ParallelLayout(pp_size=2))
    # The config alone tells: an attention type with no mask here, a switch that changes the masks.
    llama4 = Llama4TextConfig(**small, num_hidden_layers=4)
    with pytest.raises(LayoutError, match=r"'llama4_text': its layer_types include \['chunked_attention'\].*pp_size=1"):
        check_settings(ParallelLayout(pp_size=2).resolve(4), ParallelOptions(), MemoryOptions(), llama4)
    gemma3 = AutoModelForCausalLM.from_config(Gemma3TextConfig(**small, num_hidden_layers=2, head_dim=8))
    gemma3.config.use_bidirectional_attention = True
    with pytest.raises(LayoutError, match="'gemma3_text': config.use_bidirectional_attention=True"):
        parallelize(gemma3, ParallelLayout(pp_size=2))


def test_linear_attention_other_than_gated_delta_net(fake_world: int) -> None:
    """Stages give a linear-attention layer what Qwen3.5's and Qwen3-Next's decoders give their Gated DeltaNets (the
    padding mask; test_pipeline_linear_attention.py); MiniMax's lightning attention in a ``linear_attention`` layer is
    refused naming the layer and pp, before anything is split."""
    from transformers import AutoModelForCausalLM
    from transformers.models.minimax.configuration_minimax import MiniMaxConfig

    config = MiniMaxConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["full_attention", "linear_attention"],
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = dict(model.model.layers.named_children())
    with pytest.raises(
        LayoutError, match=r"pp_size=2: .*'minimax': model\.layers\.1 \(MiniMaxDecoderLayer\) is a linear_attention layer"
    ):
        parallelize(model, ParallelLayout(pp_size=2))
    assert dict(model.model.layers.named_children()) == layers  # nothing cut
    # Qwen3.5's config passes the checks that need no weights.
    check_settings(ParallelLayout(pp_size=2).resolve(4), ParallelOptions(), MemoryOptions(), tiny_model("qwen3_5").config)


def test_a_module_the_forward_would_miss(fake_world: int) -> None:
    """A module added to the base model (a step its forward may run) is refused by name, not assumed harmless."""
    model = tiny_model("llama_4l")
    model.model.extra_projection = torch.nn.Linear(4, 4)
    with pytest.raises(LayoutError, match=r"'llama': its forward runs \['model.extra_projection'\], which a stage"):
        parallelize(model, ParallelLayout(pp_size=2))


def test_registered_by_name() -> None:
    import lightning as L

    trainer = L.Trainer(strategy="pipeline_parallel", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is PipelineParallelStrategy


def test_pp_reshard_per_microbatch_needs_sharded_stages() -> None:
    """``pp_reshard_per_microbatch`` is refused without stages, under zero-bubble schedules and without FSDP2."""
    memory = MemoryOptions(pp_reshard_per_microbatch=True)
    with pytest.raises(OptionsError, match="applies to pipeline stages: set pp_size > 1"):
        check_settings(ParallelLayout(dp_shard_size=2).resolve(2), ParallelOptions(), memory)
    with pytest.raises(OptionsError, match="'zbv_zero_bubble'.*weight gradients in a later pass.*pp_schedule='1f1b'"):
        check_settings(ParallelLayout(pp_size=2, dp_shard_size=2).resolve(4), ParallelOptions(pp_schedule="zbv_zero_bubble"), memory)
    with pytest.raises(OptionsError, match="needs at least 2 data-parallel ranks"):
        check_settings(ParallelLayout(pp_size=2, tp_size=2).resolve(4), ParallelOptions(), memory)
    with pytest.raises(OptionsError, match="pp_reshard_per_microbatch must be true or false"):
        MemoryOptions(pp_reshard_per_microbatch="yes")
    check_settings(ParallelLayout(pp_size=2, dp_shard_size=2).resolve(4), ParallelOptions(), memory)  # accepted
