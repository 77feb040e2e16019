"""How evenly a mixture-of-experts model's router spreads tokens over its experts, measured while training.

A forward pre-hook on every experts module reads the routing it is given (``top_k_index``, ``top_k_weights``) and
adds, per decoder layer, the tokens each expert received and the routing entropy of those tokens. Nothing is
communicated while training: :meth:`ExpertBalance.read` sums the window over the ranks (one all-reduce) and starts
the next window, so every rank returns the global figures, equal to what one process computes on the global batch.

The figures (``moe/*`` in both doors' metrics):

* ``moe/load_max_over_mean``: per layer, the tokens of the busiest expert over the mean tokens per expert (a token
  routed to ``k`` experts counts once for each); 1.0 is a perfect balance, ``num_experts`` all tokens on one expert.
  The worst layer is reported.
* ``moe/router_entropy``: per token, the entropy (nats) of its top-k routing weights renormalized to sum to 1, i.e.
  of how the token's output is mixed from its experts: 0 when one expert carries all the weight, ``log(k)`` when its
  ``k`` experts weigh the same. Averaged over the tokens of a layer, then over the MoE layers.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_plugins.errors import LayoutError
from lightning_plugins.parallel.moe.experts import expert_modules, num_experts

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class ExpertBalance:
    """Counts the tokens each expert of each layer receives in training forwards, and their routing entropy.

    Only forwards in training mode count (not validation), and only once per token: a recomputation under
    activation checkpointing (which runs inside backward) is skipped.

    Args:
        model: The HF model (or any module holding experts modules whose names carry their layer's index, as
            ``model.layers.3.mlp.experts``); pipeline stages keep the original names, so layer indices agree.
        config: Its config (the number of layers and experts); defaults to ``model.config``.
    """

    def __init__(self, model: nn.Module, config: Any | None = None) -> None:
        config = config if config is not None else model.config
        text = getattr(config, "text_config", None) or config
        experts = num_experts(config)
        if experts is None:
            kind = getattr(config, "model_type", "model")
            raise LayoutError(f"ExpertBalance: this {kind} config declares no experts (a dense model routes nothing).")
        self.num_layers, self.num_experts = int(text.num_hidden_layers), experts
        self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self._entropy = torch.zeros(self.num_layers, dtype=torch.float64)  # summed over tokens
        self._tokens = torch.zeros(self.num_layers, dtype=torch.float64)
        self._handles: list[RemovableHandle] = []
        for name, module in expert_modules(model):
            match = _LAYER_INDEX.search(f".{name}.")
            if match is None:
                raise LayoutError(f"ExpertBalance: no layer index in the experts module's name {name!r}.")
            self._handles.append(module.register_forward_pre_hook(_Counter(self, int(match.group(1)))))
        #: The per-layer expert token counts of the window :meth:`read` last closed (``[layers, experts]``).
        self.last_counts = self._counts.clone()

    @staticmethod
    def of(model: nn.Module) -> ExpertBalance | None:
        """An :class:`ExpertBalance` on ``model`` if its config declares experts, else ``None``.

        Decided by the config, not by the modules this rank holds: a pipeline stage without a MoE layer still takes
        part in :meth:`read`'s all-reduce.
        """
        config = getattr(model, "config", None)
        if config is None or num_experts(config) is None:
            return None
        return ExpertBalance(model, config)

    def add(self, layer: int, top_k_index: Tensor, top_k_weights: Tensor) -> None:
        """Add one forward's routing of layer ``layer``: ``[tokens, k]`` expert indices and their weights."""
        if self._counts.device != top_k_index.device:  # once: the windows stay on the model's device (no sync per call)
            self._counts, self._entropy, self._tokens = (t.to(top_k_index.device) for t in self._windows)
        index = top_k_index.detach().reshape(-1).to(torch.long)
        self._counts[layer] += torch.bincount(index, minlength=self.num_experts).to(torch.float64)
        weights = top_k_weights.detach().to(torch.float64)
        probs = weights / weights.sum(dim=-1, keepdim=True)
        self._entropy[layer] -= torch.special.xlogy(probs, probs).sum()
        self._tokens[layer] += index.numel() // max(1, top_k_index.shape[-1])

    def read(self, group: dist.ProcessGroup | None = None, *, reduce: bool = True) -> dict[str, float]:
        """The window's ``moe/*`` figures over every rank, and start a new window.

        Collective over ``group`` (default: the world) when ``reduce`` and a process group is initialized: every rank
        of it must call this at the same step. Ranks that hold the same tokens (tensor-parallel ranks run a MoE
        block on their own share of the tokens; pipeline ranks hold different layers) count different ones, so the
        sum over the world is the global batch's count.

        Returns:
            ``{"moe/load_max_over_mean", "moe/router_entropy"}``; ``{}`` when no token was routed in the window.
        """
        stats = torch.cat([self._counts, self._entropy[:, None], self._tokens[:, None]], dim=1)
        if reduce and dist.is_available() and dist.is_initialized():
            if dist.get_backend(group) == "nccl":  # also where this rank routed nothing (a stage without MoE layers)
                stats = stats.cuda()
            dist.all_reduce(stats, group=group)
        for window in self._windows:
            window.zero_()
        stats = stats.cpu()
        counts, entropy, tokens = stats[:, :-2], stats[:, -2], stats[:, -1]
        self.last_counts = counts
        used = tokens > 0
        if not used.any():
            return {}
        load = counts[used].max(dim=1).values / counts[used].mean(dim=1)
        return {
            "moe/load_max_over_mean": load.max().item(),
            "moe/router_entropy": (entropy[used] / tokens[used]).mean().item(),
        }

    @property
    def _windows(self) -> tuple[Tensor, Tensor, Tensor]:
        return self._counts, self._entropy, self._tokens

    def remove(self) -> None:
        """Remove the hooks (a second call does nothing)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _Counter:
    """The forward pre-hook of one experts module."""

    def __init__(self, balance: ExpertBalance, layer: int) -> None:
        self.balance, self.layer = balance, layer

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if not module.training or torch._C._current_graph_task_id() != -1:  # eval, or recomputed inside backward
            return
        _, top_k_index, top_k_weights = args
        self.balance.add(self.layer, top_k_index, top_k_weights)
