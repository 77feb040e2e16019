"""The host-memory levers train exactly as without them: optimizer offload and activation offload (fp32, gloo).

Each case trains a tiny Llama under a layout with the lever and again without it, from the same weights, and
compares the per-step losses and pre-clip gradient norms and the final weights (gathered). The loop is a real
fine-tuning loop: AdamW with weight decay, a LambdaLR warmup that changes the learning rate every step (so the
schedule must drive the offloaded optimizer), gradient accumulation over 2 micro-batches, clipping that triggers,
rows of different valid lengths. The layouts are FSDP2=2 combined with TP=2 (sequence and loss parallel: DTensor
activations and replicated parameters with partial gradients) and with PP=2 (the optimizer holds a stage's
parameters; each stage offloads its own layers' activations, several micro-batches in flight).

Optimizer offload: also with LoRA (only the adapters in the optimizer), the host state equal to the plain
optimizer's (through ``get_optimizer_state_dict``, as checkpoints see it), and a DCP checkpoint of the offloaded
optimizer resumed into a fresh model and optimizer continuing exactly as the uninterrupted run. Activation offload:
the hooks must have moved tensors (DTensors under TP), so a lever that does nothing cannot pass; with full and
selective checkpointing, which change what is saved. One launched world of 4 ranks checks every case.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning_plugins.testing.world import run_world
from tiny_models import make_batch, tiny_model
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from lightning_plugins import MemoryOptions, OptionsError, ParallelLayout, parallelize
from lightning_plugins.parallel.optim import offload
from lightning_plugins.adapters.lora import LoraOptions, apply_lora
from lightning_plugins.parallel.hf_model import hf_model_of
from lightning_plugins.parallel.optim.offload import HostOffloadOptimizer, offload_optimizer
from lightning_plugins.parallel.options import with_settings
from lightning_plugins.parallel import clip_grad_norm_, mesh_of, pipeline_of
from lightning_plugins.recipe.build import lr_lambda

STEPS, MORE, ACCUM, BATCH, SEQ, MAX_NORM = 4, 2, 2, 8, 16, 0.05
LR, WEIGHT_DECAY, WARMUP = 3e-3, 0.1, 3
TOL = 1e-6
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

TP_FSDP = {"tp_size": 2, "dp_shard_size": 2}
PP_FSDP = {"pp_size": 2, "dp_shard_size": 2}
OPT, ACT = {"optimizer_offload": True}, {"activation_offload": True}
# name -> (family, layout sizes, settings with the lever, LoRA, resume from a checkpoint)
CASES: dict[str, tuple[str, dict, dict, bool, bool]] = {
    "optimizer offload, full, tp2 x fsdp2, resumed": ("llama", TP_FSDP, OPT, False, True),
    "optimizer offload, lora, tp2 x fsdp2": ("llama", TP_FSDP, OPT, True, False),
    "optimizer offload, full, pp2 x fsdp2": ("llama_4l", PP_FSDP, OPT, False, False),
    "optimizer offload, lora, pp2 x fsdp2, resumed": ("llama_4l", PP_FSDP, OPT, True, True),
    "activation offload, tp2 x fsdp2": ("llama", TP_FSDP, ACT, False, False),
    "activation offload, full AC, tp2 x fsdp2": ("llama", TP_FSDP, {**ACT, "activation_checkpointing": "full"}, False, False),
    "activation offload, pp2 x fsdp2 1f1b": ("llama_4l", PP_FSDP, ACT, False, False),
    "activation offload, selective AC, lora, pp2 x fsdp2 interleaved": (
        "llama_4l",
        PP_FSDP,
        {**ACT, "activation_checkpointing": "selective", "pp_schedule": "interleaved_1f1b", "pp_microbatches": 2},
        True,
        False,
    ),
}


class _Counted:
    """Counts what activation offload's pack hook moved to the host (patched in on each rank)."""

    def __init__(self) -> None:
        self.moved = self.dtensors = 0
        self._to_host = offload.to_host

    def __call__(self, tensor: torch.Tensor):
        packed = self._to_host(tensor)
        if packed is not tensor:
            self.moved += 1
            self.dtensors += isinstance(tensor, DTensor)
        return packed


def _model(family: str, lora: bool) -> torch.nn.Module:
    model = tiny_model(family)
    model.config.use_cache = False
    if not lora:
        return model
    torch.manual_seed(1)
    model = apply_lora(model, LoraOptions(r=4, alpha=8))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # non-zero lora_B, so that lora_A gets gradients too
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model


def _optimizer(model: torch.nn.Module, memory: MemoryOptions):
    trainable = [p for p in model.parameters() if p.requires_grad]
    hyper = {"lr": LR, "weight_decay": WEIGHT_DECAY}
    if memory.optimizer_offload:
        optimizer = offload_optimizer(torch.optim.AdamW, trainable, **hyper)
    else:
        optimizer = torch.optim.AdamW(trainable, **hyper)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, STEPS + MORE, WARMUP, "cosine", 0.1))
    return optimizer, schedule


def _rows(model: torch.nn.Module) -> slice:
    dp = mesh_of(hf_model_of(model))["dp"]
    rows = BATCH // dp.size()
    return slice(dp.get_local_rank() * rows, (dp.get_local_rank() + 1) * rows)


def _train(model: torch.nn.Module, optimizer, schedule, steps: range) -> list[float]:
    """Per-step losses followed by pre-clip gradient norms."""
    pipeline = pipeline_of(model)
    if pipeline is not None:
        pipeline.loss_scale = 1.0 / ACCUM
    rows, vocab = _rows(model), model.config.vocab_size
    losses, norms = [], []
    for step in steps:
        step_loss = 0.0
        for micro in range(ACCUM):
            batch = {k: v[rows] for k, v in make_batch(BATCH, SEQ, vocab, seed=100 * step + micro).items()}
            if pipeline is not None:
                step_loss += model(**batch).loss.item() / ACCUM  # the schedule ran backward
            else:
                loss = model(**batch).loss / ACCUM
                loss.backward()
                step_loss += loss.item()
        clip = pipeline.clip_grad_norm_ if pipeline is not None else clip_grad_norm_
        norm = clip([p for p in model.parameters() if p.requires_grad], MAX_NORM)
        assert norm > MAX_NORM, "the test must exercise clipping"
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        norms.append(float(norm))
    return losses + norms


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _same(got, want, where: str) -> None:
    torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=lambda m: f"{where}: {m}")


def _same_weights(model: torch.nn.Module, reference: torch.nn.Module, where: str) -> None:
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        _same(_full(param), _full(expected[name]), f"{where} {name}")


def _build(initial: torch.nn.Module, sizes: dict, settings: dict, world_size: int):
    options, memory = with_settings("test", **settings)
    model = parallelize(copy.deepcopy(initial), ParallelLayout(**sizes).resolve(world_size), options, memory)
    return model, memory


def _resume(initial, sizes, settings, world_size, model, optimizer, schedule, tmp: Path, where: str) -> None:
    """Checkpoint the offloaded run (DCP), load it into a fresh model and optimizer, and continue both.

    Flattened optimizer state, as the Lightning strategy saves it: pipeline stages hold different parameter groups.
    """
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    dcp.save({"model": model_state, "optim": optim_state, "schedule": schedule.state_dict()}, checkpoint_id=tmp)
    fresh, memory = _build(initial, sizes, settings, world_size)
    fresh_optimizer, fresh_schedule = _optimizer(fresh, memory)
    model_state, optim_state = get_state_dict(fresh, fresh_optimizer, options=FLAT)
    state = {"model": model_state, "optim": optim_state, "schedule": fresh_schedule.state_dict()}
    dcp.load(state, checkpoint_id=tmp)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    fresh_schedule.load_state_dict(state["schedule"])
    _same(torch.tensor(_train(fresh, fresh_optimizer, fresh_schedule, range(STEPS, STEPS + MORE))),
          torch.tensor(_train(model, optimizer, schedule, range(STEPS, STEPS + MORE))), f"{where}: resumed")  # fmt: skip
    _same_weights(fresh, model, f"{where}: resumed")


def _check_cases(rank: int, world_size: int, tmp: str) -> None:
    counted = _Counted()
    offload.to_host = counted
    for index, (where, (family, sizes, settings, lora, resume)) in enumerate(CASES.items()):
        initial = _model(family, lora)
        plain_settings = {k: v for k, v in settings.items() if k not in ("optimizer_offload", "activation_offload")}
        plain, plain_memory = _build(initial, sizes, plain_settings, world_size)
        plain_optimizer, plain_schedule = _optimizer(plain, plain_memory)
        counted.moved = 0
        want = _train(plain, plain_optimizer, plain_schedule, range(STEPS))
        assert counted.moved == 0, where

        model, memory = _build(initial, sizes, settings, world_size)
        optimizer, schedule = _optimizer(model, memory)
        assert isinstance(optimizer, HostOffloadOptimizer) == memory.optimizer_offload
        got = _train(model, optimizer, schedule, range(STEPS))
        start = dict(initial.named_parameters())
        assert all(not torch.equal(_full(p), start[name]) for name, p in plain.named_parameters() if p.requires_grad)
        _same(torch.tensor(got), torch.tensor(want), f"{where}: losses, norms")
        _same_weights(model, plain, where)
        if memory.activation_offload:
            assert counted.moved > 0, f"{where}: nothing was offloaded"
            if sizes.get("tp_size", 1) > 1:
                assert counted.dtensors > 0, f"{where}: no DTensor activation was offloaded"
        if memory.optimizer_offload:
            # Training alone writes no parameter behind the optimizer's back: no host copy is refreshed needlessly.
            assert optimizer._changed() == [], where
            state, plain_state = (get_optimizer_state_dict(m, o) for m, o in ((model, optimizer), (plain, plain_optimizer)))
            assert state["state"].keys() == plain_state["state"].keys() and state["state"], where
            for name, values in plain_state["state"].items():
                for key, value in values.items():
                    _same(_full(state["state"][name][key]), _full(value), f"{where}: state {name} {key}")
            # The host state is apart from the parameters: no state tensor shares a parameter's memory.
            params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
            assert all(_local(v).untyped_storage().data_ptr() not in params
                       for values in optimizer.state.values() for v in values.values())  # fmt: skip
        if resume:
            _resume(initial, sizes, settings, world_size, model, optimizer, schedule, Path(tmp) / str(index), where)
        dist.barrier()


@pytest.mark.slow
def test_offload_levers_train_exactly_as_without_them(tmp_path: Path) -> None:
    run_world(_check_cases, 4, str(tmp_path))


def test_optimizer_offload_refuses_cpu_offload() -> None:
    with pytest.raises(OptionsError, match="optimizer_offload and cpu_offload cannot be combined"):
        MemoryOptions(optimizer_offload=True, cpu_offload=True)
    with pytest.raises(OptionsError, match="activation_offload must be true or false"):
        MemoryOptions(activation_offload="yes")  # type: ignore[arg-type]


def test_offloaded_optimizer_on_one_process_is_the_wrapped_one() -> None:
    """Without a process group: plain tensors, SGD with momentum, a parameter without gradient, state_dict round
    trip, and parameters changed in place between steps (a weight load) picked up by the host copy."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = torch.optim.SGD(twins, lr=0.1, momentum=0.9, weight_decay=0.01)
    hosted = offload_optimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9, weight_decay=0.01)
    assert hosted.param_groups[0]["momentum"] == 0.9 and hosted.param_groups[0]["nesterov"] is False
    for step in range(3):
        for index, (p, q) in enumerate(zip(params, twins)):
            grad = torch.randn(3, 4) if index != 1 or step == 2 else None
            p.grad, q.grad = grad, None if grad is None else grad.clone()
        if step == 1:
            with torch.no_grad():
                params[0].mul_(0.5)
                twins[0].mul_(0.5)
        plain.step()
        hosted.step()
        for p, q in zip(params, twins):
            torch.testing.assert_close(p, q, atol=0, rtol=0)
    saved = hosted.state_dict()
    assert saved["state"].keys() == plain.state_dict()["state"].keys()
    again = offload_optimizer(torch.optim.SGD, params, lr=0.5, momentum=0.9)
    again.load_state_dict(saved)
    assert again.param_groups[0]["lr"] == 0.1
    torch.testing.assert_close(again.state[params[0]]["momentum_buffer"], plain.state[twins[0]]["momentum_buffer"])
    with pytest.raises(TypeError, match="view of the host state"):
        hosted.state = {params[0]: {}}
    # AdamW steps on the host with torch's fused CPU kernel, also after loading a state dict saved without it.
    adam = offload_optimizer(torch.optim.AdamW, params, lr=0.1)
    adam.step()
    adam.load_state_dict(adam.state_dict())
    adam.step()
    assert adam._host.param_groups[0]["fused"] is True and adam.param_groups[0]["fused"] is None


def test_offloaded_optimizer_follows_parameters_replaced_before_its_first_step() -> None:
    """What Accelerate's ``prepare`` does: the groups are pointed at new (sharded) parameters after the optimizer was
    built. The host copies are made on first use, from those; replacing them after a step is refused."""
    old = [torch.nn.Parameter(torch.zeros(2, 2))]
    new = [torch.nn.Parameter(torch.ones(2, 2))]
    hosted = offload_optimizer(torch.optim.SGD, old, lr=0.5)
    hosted.param_groups[0]["params"] = new
    new[0].grad = torch.ones(2, 2)
    hosted.step()
    torch.testing.assert_close(new[0].detach(), torch.full((2, 2), 0.5))
    assert old[0].abs().sum() == 0
    hosted = offload_optimizer(torch.optim.AdamW, new, lr=0.5)
    hosted.step()  # no gradient yet: no state
    new[0].grad = torch.ones(2, 2)
    hosted.step()
    hosted.param_groups[0]["params"] = old
    with pytest.raises(RuntimeError, match="replaced after it stepped"):
        hosted.step()


def test_activation_offload_moves_each_saved_tensor_once() -> None:
    """A tensor saved by several ops, or as reshaped views of it (each linear saves its input as its own 2-D view: q,
    k and v of the norm's output), goes to the host once and comes back once; gradients stay bit-identical."""
    from lightning_plugins.parallel.optim import offload
    from lightning_plugins.parallel.memory.activation import offload_saved_tensors

    reference = tiny_model("llama")
    model = copy.deepcopy(reference)
    batch = make_batch(2, 16, reference.config.vocab_size, seed=0)
    layer = model.model.layers[0]

    def around_layer(context: torch.autograd.graph.saved_tensors_hooks) -> None:
        handles = [layer.register_forward_pre_hook(lambda *_: context.__enter__()),
                   layer.register_forward_hook(lambda *_: context.__exit__(None, None, None))]  # fmt: skip
        model(**batch).loss.backward()
        for handle in handles:
            handle.remove()

    storages: dict[int, int] = {}  # what the layer saves without the lever: distinct storages it would move

    def census(tensor: torch.Tensor) -> torch.Tensor:
        if offload.to_host(tensor) is not tensor:  # not a parameter nor an expanded view, which stay
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    around_layer(torch.autograd.graph.saved_tensors_hooks(census, lambda t: t))
    model.zero_grad(set_to_none=True)
    moved, returned = [], []
    to_host, from_host = offload.to_host, offload.from_host

    def counted_to_host(tensor: torch.Tensor) -> object:
        packed = to_host(tensor)
        if packed is not tensor:
            moved.append(tensor.untyped_storage().nbytes())
        return packed

    def counted_from_host(packed: object) -> torch.Tensor:
        tensor = from_host(packed)
        if tensor is not packed:
            returned.append(packed)
        return tensor

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload, "to_host", counted_to_host)
        patch.setattr(offload, "from_host", counted_from_host)
        around_layer(offload_saved_tensors())
    assert (len(moved), sum(moved)) == (len(storages), sum(storages.values())), "each storage moved once"
    assert len(returned) == len(moved), "and brought back once"
    reference(**batch).loss.backward()
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
