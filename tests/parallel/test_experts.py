"""The experts path itself: the grouped forward equals transformers' expert loop, expert parallelism really
dispatches, and layouts that cannot split the experts are refused before any process group exists.

Parity of whole models under every layout is in test_parallel_parity.py, test_pipeline_parity.py and
test_context_parity.py (the MoE cases there).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning_plugins.testing.world import run_world
from tiny_models import CONFIGS, make_batch, tiny_model
from transformers import AutoModelForCausalLM

from lightning_plugins import LayoutError, OptionsError, ParallelLayout, parallelize
from lightning_plugins.parallel import check_parallelizable
from lightning_plugins.parallel.options import MemoryOptions, ParallelOptions
from lightning_plugins.parallel.moe.experts import experts_forward, expert_modules, num_experts

MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss")


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_grouped_forward_equals_the_expert_loop(family: str, grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loss and every gradient equal transformers' eager per-expert loop, through the grouped GEMM and its fallback."""
    import lightning_plugins.parallel.moe.experts as experts

    if not grouped:
        monkeypatch.setattr(experts, "_grouped_mm_runs", lambda x, w: False)
    reference = tiny_model(family)
    reference.config._experts_implementation = "eager"
    ours = copy.deepcopy(reference)
    modules = [module for _, module in expert_modules(ours)]
    assert modules, f"{family}: no experts module found by structure"
    for module in modules:
        module.forward = lambda h, i, w, module=module: experts_forward(module, h, i, w)
    batch = make_batch(3, 11, reference.config.vocab_size, seed=0)
    want_loss, want = _loss_and_grads(reference, batch)
    got_loss, got = _loss_and_grads(ours, batch)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=0)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=0, msg=lambda m: f"{family} {name}: {m}")


def _dispatch(rank: int, world_size: int, out: str) -> None:
    """Rank 1's rows carry no labels, so every gradient its experts get comes from rank 0's tokens, sent to it."""
    model = tiny_model("mixtral")
    reference = copy.deepcopy(model)
    batch = make_batch(2, 15, model.config.vocab_size, seed=3)
    mine = {k: v[rank : rank + 1] for k, v in batch.items()}
    if rank == 1:
        mine["labels"] = torch.full_like(mine["labels"], -100)
    reference(**{k: v[:1] for k, v in batch.items()}).loss.backward()  # one process: only row 0 has labels
    parallelize(model, ParallelLayout(ep_size=2).resolve(world_size))
    model(**mine).loss.backward()
    experts = model.model.layers[0].mlp.experts
    local = experts.gate_up_proj.grad.to_local()
    held = slice(2 * rank, 2 * rank + 2)  # 4 experts over 2 ranks: this rank holds two whole experts
    want = reference.model.layers[0].mlp.experts.gate_up_proj.grad[held]
    result = {
        "local_experts": experts.gate_up_proj.to_local().shape[0],
        "grad_norm": local.norm().item(),
        "max_diff": (local - want).abs().max().item() if local.shape == want.shape else float("inf"),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_expert_parallelism_dispatches_tokens_to_other_ranks(tmp_path: Path) -> None:
    run_world(_dispatch, 2, str(tmp_path))
    results = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["local_experts"] == 2, result
        # Rank 1's experts learn only from what rank 0 sent them, and exactly what one process computes.
        assert result["grad_norm"] > 1e-3, (rank, result)
        assert result["max_diff"] < 1e-6, (rank, result)


def test_layouts_that_cannot_split_the_experts_are_refused() -> None:
    mixtral = CONFIGS["mixtral"]()
    assert num_experts(mixtral) == 4 and num_experts(CONFIGS["llama"]()) is None
    with pytest.raises(LayoutError, match=r"ep_size=3 does not divide dp_shard_size x cp_size = 4 x 1 = 4"):
        ParallelLayout(ep_size=3).resolve(4)
    with pytest.raises(LayoutError, match=r"ep_size=8 does not divide the 4 experts .* Use ep_size in \[1, 2, 4\]"):
        ParallelLayout(ep_size=8).resolve(8).validate(mixtral)
    with pytest.raises(LayoutError, match=r"declares none .* Use ep_size=1 for a dense model"):
        ParallelLayout(ep_size=2).resolve(2).validate(CONFIGS["llama"]())
    ParallelLayout(ep_size=2, tp_size=2, cp_size=2).resolve(8).validate(mixtral)  # ep from dp_shard x cp = 1 x 2


def test_the_balance_loss_under_layouts_that_split_rows_is_refused() -> None:
    model = tiny_model("mixtral_aux")
    for sizes in ({"tp_size": 2}, {"cp_size": 2}, {"pp_size": 2}):
        with pytest.raises(OptionsError, match=r"output_router_logits=False .* tp_size=cp_size=pp_size=1"):
            check_parallelizable(model, ParallelLayout(**sizes).resolve(2), ParallelOptions(), MemoryOptions())
    check_parallelizable(model, ParallelLayout(ep_size=2).resolve(2), ParallelOptions(), MemoryOptions())
