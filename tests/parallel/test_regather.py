"""``MemoryOptions(sp_regather=True)``: sequence-parallel regions keep their input's shard, all-gather it in backward.

One 2-rank world, TP=2 + SP, Llama (registered) and OLMo 2 (a fallback family, its q/k gathered): the same
gradients bit for bit as without the option (whose parity with one process tests/parallel/test_parallel_parity.py
checks), fewer bytes saved per layer by exactly the gathered inputs less their shards, and one more all-gather per
region in backward.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lightning_plugins.testing.world import run_world
from tiny_models import make_batch, tiny_model
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from lightning_plugins import MemoryOptions, ParallelLayout, parallelize
from lightning_plugins.errors import OptionsError

SEQ = 15  # uneven shards (8 + 7)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return getattr(tensor, "elem", tensor)


def _step(model: torch.nn.Module, batch: dict) -> tuple[int, int, int]:
    """One forward + backward: bytes saved while the decoder layers run, forward and backward all-gathers."""
    params = {_local(p).untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}
    active = [False]
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *_: active.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: active.__setitem__(0, False))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = _local(tensor).untyped_storage()
        if active[0] and storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), CommDebugMode() as forward:
        loss = model(**batch).loss
    with CommDebugMode() as backward:
        loss.backward()
    gathers = lambda mode: sum(n for op, n in mode.get_comm_counts().items() if "all_gather" in str(op))  # noqa: E731
    return sum(saved.values()), gathers(forward), gathers(backward)


def _check(rank: int, world_size: int, tmp: str) -> None:
    for family in ("llama", "olmo2"):
        initial = tiny_model(family)
        batch = make_batch(2, SEQ, initial.config.vocab_size, seed=3)
        results = {}
        for regather in (False, True):
            model = parallelize(
                copy.deepcopy(initial), ParallelLayout(tp_size=2), memory=MemoryOptions(sp_regather=regather)
            )
            results[regather] = (_step(model, batch), {n: p.grad.full_tensor() for n, p in model.named_parameters()})
        (plain_saved, plain_fwd, plain_bwd), plain_grads = results[False]
        (saved, fwd, bwd), grads = results[True]
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], atol=0, rtol=0, msg=lambda m: f"{family} {name}: {m}")
        layers, config = initial.config.num_hidden_layers, initial.config
        # Two regions a layer (attention, MLP); each keeps its shard (this rank's rows) instead of the whole input:
        # exactly that for Llama, whose regions take its pre-norms' fresh output. OLMo 2's take the residual stream
        # itself, a view of the reduce-scatter's output whose storage can hold the longer shard's rows: at least.
        rows = (SEQ + 1) // 2 if rank == 0 else SEQ // 2
        kept_less = 2 * layers * 2 * (SEQ - rows) * config.hidden_size * 4
        if family == "llama":
            assert plain_saved - saved == kept_less, (family, plain_saved, saved, kept_less)
        else:
            longest = 2 * layers * 2 * (SEQ - (SEQ + 1) // 2) * config.hidden_size * 4
            assert plain_saved - saved >= longest, (family, plain_saved, saved, longest)
        assert (fwd, bwd) == (plain_fwd, plain_bwd + 2 * layers), (family, plain_fwd, plain_bwd, fwd, bwd)


def test_regather_in_backward(tmp_path: Path) -> None:
    run_world(_check, 2, str(tmp_path))


@pytest.mark.parametrize("memory", [{"activation_checkpointing": "full"}, {"activation_offload": True}])
def test_regather_refuses_other_saved_tensor_policies(memory: dict) -> None:
    with pytest.raises(OptionsError, match="sp_regather cannot be combined"):
        MemoryOptions(sp_regather=True, **memory)
