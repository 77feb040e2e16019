"""The router's load-balancing loss over the global batch, as one process computes it.

transformers adds ``router_aux_loss_coef * aux`` to the loss when ``output_router_logits`` is on, with ``aux`` (Switch
Transformer's balance loss: ``experts * sum_e f_e * P_e``, ``f_e`` the share of top-k assignments to expert ``e``, ``P_e``
its mean router probability, both over every layer's non-padding tokens) computed from this rank's tokens only. The
product of two means is not the mean of per-rank products, so data-parallel ranks would each balance their own batch
and, under FSDP2's gradient averaging, with ``1/ranks`` of its weight. :func:`global_balance_loss` replaces that term by
the global one: the counts and the probability sums are reduced over the data ranks, and each rank's share of the
gradient is exactly its tokens' part of the global loss's.

Layouts that split a row's tokens over ranks (tensor, context and pipeline parallelism) are refused with the loss on
(:func:`check_router_loss`): there the router's outputs are shards the loss function cannot pair with the mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.image_text import language_config

__all__ = ["check_router_loss", "global_balance_loss", "install_global_balance_loss"]


def check_router_loss(config: Any, splits_tokens: bool) -> None:
    """Refuse the router's balance loss under a layout that splits a row's tokens over ranks.

    Raises:
        OptionsError: naming the config key and the layouts that take it.
    """
    config = language_config(config)  # an image-text model's router is its language model's
    if splits_tokens and getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        raise OptionsError(
            "The router's load-balancing loss (config.output_router_logits=True, router_aux_loss_coef="
            f"{config.router_aux_loss_coef}) is computed exactly over the global batch under data and expert"
            " parallelism (dp_shard, dp_replicate, ep), not yet under tensor, context or pipeline parallelism. Set"
            " output_router_logits=False in the model config (the router then trains from the task loss only), or use"
            " a layout with tp_size=cp_size=pp_size=1."
        )


def global_balance_loss(router_logits: tuple[Tensor, ...], top_k: int, mask: Tensor | None, data: DeviceMesh) -> tuple[Tensor, Tensor]:
    """The balance loss of the global batch, and this rank's differentiable share of it.

    Args:
        router_logits: Per layer ``[tokens, experts]`` logits of this rank's tokens.
        top_k: Experts per token.
        mask: ``[batch, seq]`` attention mask of this rank's rows (1: a real token), or ``None``.
        data: The data ranks (whose gradients FSDP2 averages).

    Returns:
        ``(value, share)``: the global loss (identical on every rank, no gradient) and a scalar whose value is the
        global loss and whose gradient, averaged over ``data``, is the global loss's gradient.
    """
    experts = router_logits[0].shape[-1]
    weight = None if mask is None else mask.reshape(-1).to(torch.float32)
    counts = torch.zeros(experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(counts)
    rows = torch.zeros((), dtype=torch.float32, device=counts.device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        w = torch.ones(p.shape[0], device=p.device) if weight is None else weight.to(p.device)
        counts = counts.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (p * w.unsqueeze(-1)).sum(dim=0)
        rows = rows + w.sum()
    totals = torch.cat([counts, probs.detach(), rows.reshape(1)])
    dist.all_reduce(totals, group=data.get_group())
    counts_g, probs_g, rows_g = totals[:experts], totals[experts:-1], totals[-1].clamp(min=1)
    value = experts * ((counts_g / rows_g) * (probs_g / rows_g)).sum()
    share = data.size() * experts * ((counts_g / rows_g) * (probs / rows_g)).sum()
    return value, share + (value - share).detach()


def install_global_balance_loss(model: nn.Module, data: DeviceMesh) -> None:
    """Make ``model``'s balance-loss term the global batch's (a forward hook; a no-op when the loss is off)."""
    model.register_forward_hook(_GlobalBalance(data), with_kwargs=True)


class _GlobalBalance:
    def __init__(self, data: DeviceMesh) -> None:
        self.data = data

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        local = getattr(output, "aux_loss", None)
        logits = getattr(output, "router_logits", None)
        if local is None or not logits:
            return output
        mask = kwargs.get("attention_mask")
        config = language_config(model.config)
        _, share = global_balance_loss(tuple(logits), config.num_experts_per_tok, mask, self.data)
        if output.loss is not None:
            coef = config.router_aux_loss_coef
            output.loss = output.loss - coef * local + coef * share
        output.aux_loss = share  # the global value; differentiable as this rank's share (a preference loss adds it)
        return output
