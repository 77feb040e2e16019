"""FSDP2's units at the model's edges: the embedding and the final norm + head are their own units, not the root's.

The root is never resharded after forward, so what it holds stays gathered through the whole step. Alone, the
embedding is sharded again after its forward (and, frozen under LoRA, never gathered again), while the norm and
head stay gathered from their forward into backward, then are sharded; a tied embedding and head stay one unit.
No unit's flat all-gather output outlives its copy-out in forward.
Parity for each case is checked against one process (fp32, SGD, several steps).
"""

from __future__ import annotations

import copy

import pytest
import torch
from lightning_plugins.testing.world import run_world
from peft import LoraConfig, get_peft_model
from tiny_models import make_batch, tiny_model
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lightning_plugins import ParallelLayout, parallelize
from lightning_plugins.parallel.options import with_settings

STEPS, BATCH, SEQ, LR, TOL = 3, 4, 15, 1.0, 1e-5


def _gathered(module: torch.nn.Module) -> bool:
    """Whether FSDP2 has swapped the module's sharded (DTensor) weight for the gathered one."""
    return not isinstance(module.weight, DTensor)


def _count_gathers(module: torch.nn.Module, counts: dict[str, int], name: str) -> None:
    """Count the all-gathers (unshards) of the unit that ``module`` roots."""
    group = fully_shard.state(module)._fsdp_param_group
    unshard = group.unshard

    def started() -> bool:  # an all-gather issued (pending its wait) or done
        return group._all_gather_result is not None or group.is_unsharded

    def counted(*args, **kwargs):
        before = started()
        result = unshard(*args, **kwargs)
        counts[name] += started() and not before
        return result

    group.unshard = counted


def _kept_all_gather(module: torch.nn.Module) -> bool:
    """Whether FSDP2 still holds a flat all-gather output (its forward's deferred free) as ``module`` starts."""
    return fully_shard.state(module)._comm_ctx.all_gather_state is not None


def _train(model: torch.nn.Module, rows: slice, inspect=None) -> list[float]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        batch = make_batch(BATCH, SEQ, model.config.vocab_size, seed=step)
        loss = model(**{k: v[rows] for k, v in batch.items()}).loss
        if inspect is not None:
            inspect("forward")
        loss.backward()
        if inspect is not None:
            inspect("backward")
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


def _check(rank: int, world_size: int, family: str, lora: bool, settings: dict) -> None:
    initial = tiny_model(family)
    if lora:
        initial = _lora(initial)
    reference = copy.deepcopy(initial)
    ref_losses = _train(reference, slice(None))

    layout = ParallelLayout(dp_shard_size=world_size).resolve(world_size)
    model = parallelize(copy.deepcopy(initial), layout, *with_settings("test", **settings))
    hf = model.get_base_model() if lora else model
    embed, head, norm = hf.get_input_embeddings(), hf.get_output_embeddings(), hf.model.norm
    seen: list[str] = []
    counts = {"embedding": 0, "head": 0}
    if family.endswith("_tied"):
        # One weight: one unit (the root's), as before.
        assert head.weight is embed.weight
        assert not isinstance(embed, FSDPModule) and not isinstance(head, FSDPModule)
    else:
        assert isinstance(embed, FSDPModule) and isinstance(head, FSDPModule)
        assert fully_shard.state(norm) is fully_shard.state(head), "the final norm and the head are one unit"
        _count_gathers(embed, counts, "embedding")
        _count_gathers(head, counts, "head")

    # Each unit's flat all-gather output is freed once copied out: none is left when a unit's forward starts (FSDP2
    # keeps it until the next unit has gathered: the last layer's, the head's and the head's parameters at once).
    kept: list[bool] = []
    for layer in hf.model.layers:
        layer.register_forward_pre_hook(lambda module, args: kept.append(_kept_all_gather(module)))
    if not family.endswith("_tied"):
        head.register_forward_pre_hook(lambda module, args: kept.append(_kept_all_gather(module)))

    def inspect(moment: str) -> None:
        if family.endswith("_tied"):
            return
        seen.append(moment)
        if moment == "forward":
            assert not _gathered(embed), "the embedding is sharded again after its forward"
            assert _gathered(head) and _gathered(norm), "the head stays gathered from its forward into backward"
        else:
            assert not _gathered(embed) and not _gathered(head) and not _gathered(norm), "all sharded after backward"

    losses = _train(model, slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size), inspect)
    # The loss is the global mean over valid tokens on every rank, as one process computes it.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=TOL, rtol=0)
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param.detach()), expected[name].detach(), atol=TOL, rtol=0, msg=name)
    if not family.endswith("_tied"):
        assert seen == ["forward", "backward"] * STEPS
        # Once a step each: the embedding's backward needs no weights (frozen, or a lookup's gradient), so it is
        # not gathered again; the head stays gathered from its forward into backward.
        assert counts == {"embedding": STEPS, "head": STEPS}, counts
    assert len(kept) >= STEPS * (len(hf.model.layers) + (not family.endswith("_tied"))) and not any(kept), kept


@pytest.mark.parametrize(
    "family,lora,settings",
    [
        ("llama", False, {}),
        ("llama", True, {}),
        ("llama", False, {"loss_chunk_tokens": None}),  # the head's own logits (not the chunked loss inside its call)
        ("llama_tied", False, {}),
    ],
    ids=["full", "lora", "full-logits", "tied"],
)
def test_edge_units(family: str, lora: bool, settings: dict) -> None:
    run_world(_check, 2, family, lora, settings)
