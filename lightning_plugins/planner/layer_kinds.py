"""The kinds of decoder layer a model stacks, counted on its meta-device copy.

Most decoders repeat one layer; the 2026 families do not. Qwen3.5 and Qwen3-Next put Gated DeltaNet linear
attention (``linear_attn``) in three of every four layers and softmax attention (``self_attn``) in the fourth;
DeepSeek-V3 (and Kimi K2) start with three dense layers before 58 mixture-of-experts ones, GLM-4.5 with one or
three; Qwen's MoE configs may leave some layers dense (``mlp_only_layers``). Counting one layer and multiplying
miscounts all of them (Qwen3.5-27B by 176M parameters, DeepSeek-V3 as a dense model). :func:`layer_kinds` groups
the layers of the model transformers builds by the shapes of their parameters, so every count stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["LayerKind", "layer_kinds"]


@dataclass(frozen=True)
class LayerKind:
    """Decoder layers of one structure (the same parameter names and shapes).

    Attributes:
        count: How many layers of the stack are of this kind.
        params: Parameters of one such layer.
        linears: ``(name, in_features, out_features)`` of each of its linear layers.
        expert_params: Parameters of its routed experts, all of them (0 for a dense layer).
        expert_matmul_params: The matmul weights (3-D) among :attr:`expert_params`.
    """

    count: int
    params: int
    linears: tuple[tuple[str, int, int], ...]
    expert_params: int = 0
    expert_matmul_params: int = 0

    @property
    def matmul_params(self) -> int:
        """The weights of its linear layers (no biases, norms or routed experts)."""
        return sum(fan_in * fan_out for _, fan_in, fan_out in self.linears)

    def active_matmul_params(self, experts_per_token: int, num_experts: int) -> float:
        """Matmul weights one token meets: the linears and the ``top-k`` routed experts' share."""
        return self.matmul_params + self.expert_matmul_params * experts_per_token / max(num_experts, 1)


def _kind_of(layer: nn.Module) -> LayerKind:
    from lightning_plugins.parallel.moe.experts import expert_modules

    experts = [module for _, module in expert_modules(layer)]
    linears = tuple(
        (name.rpartition(".")[2], module.in_features, module.out_features)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear)
    )
    return LayerKind(
        count=1,
        params=sum(p.numel() for p in layer.parameters()),
        linears=linears,
        expert_params=sum(p.numel() for module in experts for p in module.parameters()),
        expert_matmul_params=sum(p.numel() for module in experts for p in module.parameters() if p.dim() == 3),
    )


def layer_kinds(layers: list[nn.Module]) -> tuple[LayerKind, ...]:
    """The kinds among ``layers`` (a decoder's layers, in order), each with its count, in order of first use."""
    kinds: dict[tuple, LayerKind] = {}
    for layer in layers:
        signature = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
        kind = kinds.get(signature)
        kinds[signature] = _kind_of(layer) if kind is None else LayerKind(
            kind.count + 1, kind.params, kind.linears, kind.expert_params, kind.expert_matmul_params
        )
    return tuple(kinds.values())
