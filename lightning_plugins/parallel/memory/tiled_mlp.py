"""Tiled MLP: each decoder layer's dense MLP computed a tile of tokens at a time, its wide tensors never whole.

An MLP acts on each token alone, so it can run on slices of the tokens and give the same rows. With
``MemoryOptions.mlp_chunk_tokens`` each dense MLP of the decoder (a gated MLP of a known form:
:func:`~lightning_plugins.parallel.memory.gated_mlp.mlp_form`, e.g. Llama's, Gemma's, Phi-3's, a mixture of experts' shared
expert) runs through :class:`_TiledMLP`: forward computes the MLP on each tile of that many tokens with autograd off
and writes its rows of the output, saving only the MLP's input; backward computes each tile again with autograd on and
takes its gradients (the input's rows, and the trainable parameters' summed over the tiles) before the next tile.
The intermediate-width tensors (``gate``, ``up``, their product, and their gradients: ``[tokens, intermediate]`` each)
then exist for one tile at a time (Arctic's TiledMLP, axolotl's ``tiled_mlp``). Without activation checkpointing a
layer keeps the MLP's input only, as if the MLP were checkpointed; with it, the recomputed layer and its backward hold
one tile's wide tensors instead of all of them. Cost: the MLP's forward once more per step.

Exactness: each tile's rows are the untiled MLP's rows; the parameters' gradients are summed tile by tile, so they
differ from the untiled sums by rounding only (fp32: ~1e-7 relative). The trainable parameters are inputs of the
autograd function, so each receives its whole gradient once, as from the untiled MLP: hooks on gradient accumulation
(FSDP2's, ``optimizer_in_backward``'s) fire once per step. Random draws (LoRA dropout on the MLP's projections) are
drawn per tile; backward restores the generators' state of the forward and recomputes the tiles in the same order, so
each tile gets the mask its forward drew (the masks differ from the untiled MLP's draws, as they do for any tile size).
The forward's autocast state is restored for the recomputation, as activation checkpointing does.

Not with tensor parallelism (the projections' collectives act on the whole sequence shard, refused by
:func:`check_tiled_mlp`) or ``compile`` (backward calls autograd, which torch.compile does not trace).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.memory.gated_mlp import mlp_form


def check_tiled_mlp(mlp_chunk_tokens: int | None, tp_size: int, compile: bool) -> None:
    """Refuse ``mlp_chunk_tokens`` with the layouts it does not compose with (no model or collective needed)."""
    if not mlp_chunk_tokens:
        return
    if tp_size > 1:
        raise OptionsError(
            f"mlp_chunk_tokens={mlp_chunk_tokens} is not supported with tp_size={tp_size}: the tensor-parallel"
            " projections all-reduce (or, with sequence parallelism, reduce-scatter) the whole sequence shard, not a"
            " tile of it, and already split the MLP's intermediate width by tp_size. Set mlp_chunk_tokens to null,"
            " or use FSDP2, context or pipeline parallelism."
        )
    if compile:
        raise OptionsError(
            f"mlp_chunk_tokens={mlp_chunk_tokens} is not supported with compile=True: the tiled MLP's backward"
            " recomputes each tile under autograd, which torch.compile does not trace. Set one of them off."
        )


def use_tiled_mlps(model: nn.Module, tokens: int) -> int:
    """Compute every dense MLP of ``model`` whose form is known ``tokens`` tokens at a time; return how many.

    The swap is per instance (``module.forward`` wraps the forward it had, e.g. the efficient gated MLP's); hooks
    (FSDP2's, activation checkpointing's) are untouched.
    """
    count = 0
    for module in model.modules():
        form = mlp_form(module)
        if form is not None and form[0] != "experts" and not isinstance(module.forward, _TiledForward):
            module.forward = _TiledForward(module, module.forward, tokens)  # type: ignore[method-assign]
            count += 1
    return count


class _TiledForward:
    """An MLP's forward, tiled (a callable object: recognisable, and picklable state)."""

    def __init__(self, module: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], tokens: int) -> None:
        self.module, self.forward, self.tokens = module, forward, tokens

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() <= self.tokens:
            return self.forward(x)
        trainable = tuple(p for p in self.module.parameters() if p.requires_grad)
        if not torch.is_grad_enabled() or not (x.requires_grad or trainable):
            with torch.no_grad():
                return _tiles(self.forward, x, self.tokens)
        return _TiledMLP.apply(x, self.forward, self.tokens, *trainable)


def _tiles(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tokens: int) -> torch.Tensor:
    """``forward(x)`` computed ``tokens`` rows at a time without autograd, into one output.

    ``x`` is detached first: its views would otherwise require grad without a grad_fn (views made with autograd off),
    which hooks on the MLP's projections (module trackers) cannot hook.
    """
    rows = x.detach().reshape(-1, x.shape[-1])
    out = None
    for start in range(0, rows.shape[0], tokens):
        y = forward(rows[start : start + tokens])
        if out is None:
            out = y.new_empty((rows.shape[0], y.shape[-1]))
        out[start : start + tokens] = y
    return out.view(*x.shape[:-1], out.shape[-1])


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward: Callable, tokens: int, *trainable: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        ctx.forward, ctx.tokens, ctx.trainable = forward, tokens, trainable
        ctx.device = device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = torch.get_device_module(device).get_rng_state() if device != "cpu" else None
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x)
        return _tiles(forward, x, tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        rows, grads = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_x = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        wanted = [i for i, needed in enumerate(ctx.needs_input_grad[3:]) if needed]
        sums: list[torch.Tensor | None] = [None] * len(ctx.trainable)
        devices = [torch.get_device_module(ctx.device).current_device()] if ctx.device_rng is not None else []
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=devices, device_type=ctx.device):
            torch.set_rng_state(ctx.cpu_rng)  # the forward's draws, tile by tile in the same order
            if ctx.device_rng is not None:
                torch.get_device_module(ctx.device).set_rng_state(ctx.device_rng)
            for start in range(0, rows.shape[0], ctx.tokens):
                tile = rows[start : start + ctx.tokens].detach().requires_grad_(grad_x is not None)
                with torch.enable_grad(), torch.autocast(ctx.device, dtype=dtype, enabled=enabled):
                    y = ctx.forward(tile)
                inputs = ([tile] if grad_x is not None else []) + [ctx.trainable[i] for i in wanted]
                got = list(torch.autograd.grad(y, inputs, grads[start : start + ctx.tokens], allow_unused=True))
                if grad_x is not None:
                    grad_x[start : start + ctx.tokens] = got.pop(0)
                for i, g in zip(wanted, got):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i].add_(g)
        grad_x = None if grad_x is None else grad_x.view(x.shape)
        return (grad_x, None, None, *sums)
