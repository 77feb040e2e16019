"""The optimizer step fused into backward (``memory.optimizer_in_backward``) trains exactly as the ordinary step.

Same math, so exact in fp32: per-step losses and final weights of AdamW with weight decay and a warmup schedule
that changes the learning rate every step, over several steps, in one process and under FSDP2=2 (the hook fires on
the sharded parameter after the reduce-scatter), also with the optimizer on the host (``optimizer_offload``). The
gradients must be gone after each backward (a hook that did not fire cannot pass: the door's ``step()`` then finds
no gradient). Each step's gradient norm, accumulated by the hooks before each gradient is applied, is the global norm
the ordinary step's ``clip_grad_norm_`` computes (what ``train/grad_norm`` logs and the non-finite guard checks), and a
NaN gradient stops the run under ``on_nonfinite: stop``; a user's own Accelerate loop gets that norm from
``clip_grad_norm_(params, inf)`` and a clear refusal for a finite limit. A DCP checkpoint of the in-backward optimizer resumed into a
fresh model continues exactly. One launched world of 2 ranks; the refusals (clipping's global norm, layouts that
reduce gradients later) in-process.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning_plugins.testing.world import run_world
from tiny_models import make_batch, tiny_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from lightning_plugins import MemoryOptions, OptionsError, ParallelLayout, parallelize
from lightning_plugins.errors import NonFiniteError
from lightning_plugins.parallel import clip_grad_norm_
from lightning_plugins.parallel.checks import check_settings
from lightning_plugins.parallel.optim.offload import offload_optimizer
from lightning_plugins.parallel.optim.optim_in_backward import step_in_backward, stepping_in_backward
from lightning_plugins.run.nonfinite import NonFiniteGuard
from lightning_plugins.parallel.options import ParallelOptions
from lightning_plugins.recipe.build import lr_lambda

STEPS, MORE, BATCH, SEQ = 4, 2, 4, 16
LR, WEIGHT_DECAY, WARMUP = 3e-3, 0.1, 2
TOL = 1e-6
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _build(initial: torch.nn.Module, fsdp: int, in_backward: bool, offload: bool):
    model = copy.deepcopy(initial)
    if fsdp > 1:
        layout = ParallelLayout(dp_shard_size=fsdp).resolve(fsdp)
        model = parallelize(model, layout, memory=MemoryOptions(optimizer_in_backward=in_backward))
    hyper = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    params = list(model.parameters())
    optimizer = offload_optimizer(torch.optim.AdamW, params, **hyper) if offload else torch.optim.AdamW(params, **hyper)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, STEPS + MORE, WARMUP, "cosine", 0.1))
    if in_backward:
        step_in_backward(optimizer)
    return model, optimizer, schedule


def _train(model, optimizer, schedule, steps: range, rows: slice, in_backward: bool, norms: list | None = None):
    losses = []
    for step in steps:
        batch = {k: v[rows] for k, v in make_batch(BATCH, SEQ, model.config.vocab_size, seed=step).items()}
        loss = model(**batch).loss
        loss.backward()
        held = [p for p in model.parameters() if p.grad is not None]
        assert not held if in_backward else held, "in backward: every gradient applied and freed"
        # What the doors log as train/grad_norm and hand to the non-finite guard.
        fused = stepping_in_backward(optimizer)
        assert (fused is not None) == in_backward
        norm = fused.grad_norm() if in_backward else clip_grad_norm_(model.parameters(), math.inf)
        if norms is not None:
            norms.append(norm.item())
        optimizer.step()  # what a door does: nothing left to do in backward mode
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _nan_gradient_stops(initial: torch.nn.Module, fsdp: int, rows: slice) -> None:
    """A NaN in the gradients of all the layers below the final norm (the loss stays finite): the hooks' norm is
    NaN on every rank, and the guard stops the run (saying that the weights already took the step)."""
    model, optimizer, _ = _build(initial, fsdp, True, False)
    guard = NonFiniteGuard("stop", 10, stepped_in_backward=True)

    def poison(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: torch.full_like(grad, float("nan")))

    model.model.norm.register_forward_hook(poison)
    batch = {k: v[rows] for k, v in make_batch(BATCH, SEQ, model.config.vocab_size, seed=0).items()}
    loss = model(**batch).loss
    guard.observe_loss(loss)
    loss.backward()
    assert torch.isfinite(loss)
    said = r"^optimizer step 1: a non-finite gradient norm \(nan; the global norm, seen by rank\(s\) \[0, 1\]\)\. "
    with pytest.raises(NonFiniteError, match=said + "Training stopped after the optimizer had stepped inside backward"):
        guard.check(1, stepping_in_backward(optimizer).grad_norm(), optimizer)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _same_weights(model, reference, where: str) -> None:
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(_full(param), _full(expected[name]), atol=TOL, rtol=0, msg=lambda m: f"{where} {name}: {m}")


def _check(rank: int, world_size: int, tmp: str) -> None:
    initial = tiny_model("llama")
    initial.config.use_cache = False
    for fsdp, offload in ((1, False), (world_size, False), (world_size, True)):
        where = f"fsdp={fsdp}, optimizer_offload={offload}"
        rows = slice(None) if fsdp == 1 else slice(rank * BATCH // fsdp, (rank + 1) * BATCH // fsdp)
        plain, plain_norms = _build(initial, fsdp, False, offload), []
        want = _train(*plain, range(STEPS), rows, False, plain_norms)
        fused, fused_norms = _build(initial, fsdp, True, offload), []
        got = _train(*fused, range(STEPS), rows, True, fused_norms)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOL, rtol=0, msg=lambda m: f"{where}: {m}")
        assert all(norm > 0 for norm in plain_norms), plain_norms
        # The first step's gradients are the same in both runs; later ones, from the same weights to within TOL.
        torch.testing.assert_close(torch.tensor(fused_norms), torch.tensor(plain_norms), rtol=1e-6, atol=0,
                                   msg=lambda m: f"{where}: grad_norm {m}")  # fmt: skip
        if not offload:
            _nan_gradient_stops(initial, fsdp, rows)
        assert all(not torch.equal(_full(p), q) for p, q in zip(plain[0].parameters(), initial.parameters()))
        _same_weights(fused[0], plain[0], where)
    # Resume the (FSDP2, host-stepped) in-backward optimizer from a DCP checkpoint.
    model, optimizer, schedule = fused
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    dcp.save({"model": model_state, "optim": optim_state, "schedule": schedule.state_dict()}, checkpoint_id=tmp)
    fresh, fresh_optimizer, fresh_schedule = _build(initial, world_size, True, True)
    model_state, optim_state = get_state_dict(fresh, fresh_optimizer, options=FLAT)
    state = {"model": model_state, "optim": optim_state, "schedule": fresh_schedule.state_dict()}
    dcp.load(state, checkpoint_id=tmp)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    fresh_schedule.load_state_dict(state["schedule"])
    more = range(STEPS, STEPS + MORE)
    torch.testing.assert_close(torch.tensor(_train(fresh, fresh_optimizer, fresh_schedule, more, rows, True)),
                               torch.tensor(_train(model, optimizer, schedule, more, rows, True)), atol=TOL, rtol=0)  # fmt: skip
    _same_weights(fresh, model, "resumed")
    _accelerator_loop(initial, rank, world_size)
    dist.barrier()


def _accelerator_loop(initial: torch.nn.Module, rank: int, world_size: int) -> None:
    """A user's own loop through the Accelerate door (FSDP2 over the world): ``clip_grad_norm_`` cannot clip what
    the optimizer already applied, and without a limit it returns the step's global norm, as the ordinary step's."""
    from lightning_plugins.accelerate import ParallelAccelerator

    batch = make_batch(BATCH, SEQ, initial.config.vocab_size, seed=0)
    plain = copy.deepcopy(initial)
    plain(**batch).loss.backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), math.inf)
    accelerator = ParallelAccelerator(cpu=True)
    model = copy.deepcopy(initial)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    step_in_backward(optimizer.optimizer)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    accelerator.backward(model(**{k: v[rows] for k, v in batch.items()}).loss)
    assert all(p.grad is None for p in model.parameters()), "applied in backward and freed"
    with pytest.raises(OptionsError, match="cannot clip by the global norm"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    norm = accelerator.clip_grad_norm_(model.parameters(), math.inf)
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)


def test_optimizer_in_backward_trains_exactly_as_the_ordinary_step(tmp_path: Path) -> None:
    run_world(_check, 2, str(tmp_path))


def test_optimizer_in_backward_refuses_layouts_that_reduce_gradients_later() -> None:
    memory = MemoryOptions(optimizer_in_backward=True)
    check_settings(ParallelLayout(dp_shard_size=2).resolve(2), ParallelOptions(), memory)
    for sizes in ({"tp_size": 2}, {"pp_size": 2}, {"cp_size": 2}):
        with pytest.raises(OptionsError, match=f"optimizer_in_backward .*{next(iter(sizes))}=2.* Use FSDP2"):
            check_settings(ParallelLayout(**sizes).resolve(2), ParallelOptions(), memory)
    with pytest.raises(OptionsError, match="optimizer_in_backward must be true or false"):
        MemoryOptions(optimizer_in_backward="yes")  # type: ignore[arg-type]


def test_optimizer_in_backward_refuses_what_it_cannot_do() -> None:
    from lightning_plugins.parallel.optim.optim_in_backward import check_step_in_backward

    check_step_in_backward(None, 1, "stop")
    for args, fix in (((1.0, 1, "stop"), "optim.max_grad_norm: null"), ((None, 2, "stop"), "train.micro_batch_size"),
                      ((None, 1, "skip"), "train.on_nonfinite: stop")):  # fmt: skip
        with pytest.raises(OptionsError, match=fix):
            check_step_in_backward(*args)
