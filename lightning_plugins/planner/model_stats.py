"""What the planner needs to know about a model: its config, parameter counts and training FLOPs.

Counts come in closed form from the config (no model is built), so the search can ask for them
thousands of times. For the registered families (Llama, Mistral, Qwen2, Qwen3) the closed form is
exact (``tests/planner/test_planner_timing.py`` checks it against the meta-built transformers model for every
shipped config); other model types are counted from one decoder layer built on the meta device.
"""

from __future__ import annotations

from lightning_plugins.errors import PlannerError
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from lightning_plugins.planner.layer_kinds import LayerKind

__all__ = ["ModelStats", "PlannerError", "load_model_config", "model_stats", "shipped_configs"]

#: Training methods the planner models: all weights, LoRA on a dense base, LoRA on an NF4 base.
TRAINABLE = ("full", "lora", "qlora")


def _configs_dir() -> Path:
    from lightning_plugins.resources import model_configs_dir

    return model_configs_dir()


def shipped_configs() -> list[str]:
    """Names of the model configs shipped under ``recipes/configs`` (e.g. ``"Llama-3.1-8B"``)."""
    root = _configs_dir()
    return sorted(p.parent.name for p in root.glob("*/config.json")) if root.is_dir() else []


def _config_files(spec: str | Path) -> tuple[Path, ...]:
    """Where :func:`load_model_config` looks for ``spec``'s ``config.json``: the path, a directory, a shipped name, or a
    hub id whose repository is shipped (meta-llama/Llama-3.1-8B -> Llama-3.1-8B)."""
    path = Path(spec).expanduser()
    return path, path / "config.json", _configs_dir() / str(spec).rsplit("/", 1)[-1] / "config.json"


def model_config_dir(spec: str | Path) -> Path | None:
    """The directory of ``spec``'s ``config.json`` (with its processor's files, where shipped), or ``None`` when
    it is not on disk (a hub id in the local cache, or none)."""
    return next((candidate.parent for candidate in _config_files(spec) if candidate.is_file()), None)


def load_model_config(spec: str | Path, *, multimodal: bool = False) -> PretrainedConfig:
    """A transformers config from a ``config.json``, a directory, a shipped name or a cached hub id.

    Args:
        spec: A path to a ``config.json`` file, a directory holding one, the name of a config shipped under
            ``recipes/configs`` (``"Llama-3.1-8B"``) or the hub id of one (``"meta-llama/Llama-3.1-8B"``), or a
            hub id already in the local Hugging Face cache. A multimodal config (Gemma 3 27B) gives its text
            decoder's config: the model a text fine-tune trains.
        multimodal: Give an image-text config whole (vision tower and projector included), as an image-text
            fine-tune trains it.

    Raises:
        PlannerError: naming ``spec``, the shipped names and the fix. Nothing is downloaded.
    """
    from transformers import AutoConfig

    from lightning_plugins.checkpoint.text_tower import text_config

    path = Path(spec).expanduser()
    chosen = (lambda config: config) if multimodal else text_config
    for candidate in _config_files(spec):
        if candidate.is_file():
            try:
                return chosen(AutoConfig.from_pretrained(str(candidate)))
            except (OSError, ValueError) as err:
                raise PlannerError(
                    f"{candidate} is not a transformers model config ({err}). Pass the model's config.json."
                ) from None
    if not path.exists():
        try:
            return chosen(AutoConfig.from_pretrained(str(spec), local_files_only=True))
        except (OSError, ValueError):
            pass
    raise PlannerError(
        f"Model config {str(spec)!r} was not found: it is no config.json file, no directory holding one, no shipped"
        f" config ({', '.join(shipped_configs())}) and no hub id in the local Hugging Face cache (the planner"
        " works offline). Pass a path to the model's config.json, or one of the shipped names."
    )


@dataclass(frozen=True)
class ModelStats:
    """Sizes of a decoder-only causal LM, read from its config.

    Attributes:
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size: The shape.
        tied_embeddings: Whether ``lm_head`` shares the embedding's weight.
        embedding_params: ``embed_tokens``.
        layer_params: One decoder layer: attention projections (with biases where the config has them),
            MLP, the two norms, per-head q/k norms (Qwen3).
        norm_params: The final norm.
        head_params: ``lm_head`` (0 when tied).
        linears: ``(name, in_features, out_features)`` of each linear layer of one decoder layer.
        model_type: ``config.model_type``.
        lora_targets: The default LoRA targets of the family (see :meth:`default_lora_targets`).
        num_experts: Routed experts per MoE layer (0 for a dense model).
        experts_per_token: Experts each token is routed to (top-k; 0 for a dense model).
        expert_params: Parameters of one layer's routed experts, all of them (their 3-D weights and biases; part
            of :attr:`layer_params`). The router and shared experts are ordinary linears of the layer.
        expert_matmul_params: The matmul weights among :attr:`expert_params` (no biases).
        attention_windows: Per decoder layer, the keys a query attends at most (its sliding window), ``0`` for
            full attention; empty when every layer attends fully (see :func:`attention_windows`).
        layer_kinds: The kinds of layer of a stack that mixes them (Qwen3.5's linear and full attention,
            DeepSeek-V3's dense and MoE layers; :mod:`.layer_kinds`), each with its count: the counts and FLOPs
            then sum over them, and the per-layer fields above are the stack's mean layer (``linears``: every
            kind's). Empty when all layers are alike.
        attention_variants: What changes which kernel attention runs on (:mod:`.attention_kernels`):
            ``"softcap"`` (logit soft-capping), ``"sinks"`` (gpt-oss), ``"linear"`` (some layers are linear
            attention; see :func:`attention_variants`).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    embedding_params: int
    layer_params: int
    norm_params: int
    head_params: int
    linears: tuple[tuple[str, int, int], ...] = field(default=(), compare=False)
    model_type: str = "llama"
    lora_targets: tuple[str, ...] = field(default=(), compare=False)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    expert_matmul_params: int = 0
    attention_windows: tuple[int, ...] = ()
    layer_kinds: tuple[LayerKind, ...] = field(default=(), compare=False)
    attention_variants: tuple[str, ...] = ()

    @property
    def is_moe(self) -> bool:
        """Whether the decoder layers route tokens to experts."""
        return self.num_experts > 0

    @property
    def active_params(self) -> int:
        """Parameters one token uses: :attr:`total_params` less the routed experts it is not sent to (a dense
        model's are all of them). Attention, router, shared experts, embedding and head all count."""
        experts, top_k = max(self.num_experts, 1), self.experts_per_token
        if self.layer_kinds:
            return self.total_params - sum(k.count * (k.expert_params - k.expert_params * top_k // experts) for k in self.layer_kinds)  # fmt: skip
        idle = self.expert_params - self.expert_params * top_k // experts
        return self.total_params - self.num_layers * idle

    @property
    def total_params(self) -> int:
        """All parameters (a tied weight counted once), as ``sum(p.numel())`` of the transformers model."""
        layers = sum(k.count * k.params for k in self.layer_kinds) or self.num_layers * self.layer_params
        return self.embedding_params + layers + self.norm_params + self.head_params

    @property
    def layer_matmul_params(self) -> float:
        """Weights of one decoder layer that take part in matmuls (its linear weights; no biases or norms); of a
        stack of mixed layers, the mean layer's."""
        if self.layer_kinds:
            return sum(k.count * k.matmul_params for k in self.layer_kinds) / self.num_layers
        return sum(fan_in * fan_out for _, fan_in, fan_out in self.linears)

    @property
    def layer_active_matmul_params(self) -> float:
        """Matmul weights one token meets in a decoder layer: its linears and, of a MoE layer, the ``top-k`` routed
        experts' weights (a dense layer: :attr:`layer_matmul_params`); of a stack of mixed layers, the mean layer's."""
        if self.layer_kinds:
            experts, top_k = self.num_experts, self.experts_per_token
            return sum(k.count * k.active_matmul_params(top_k, experts) for k in self.layer_kinds) / self.num_layers
        return self.layer_matmul_params + self.expert_matmul_params * self.experts_per_token // max(self.num_experts, 1)

    @property
    def matmul_params(self) -> int:
        """``N`` of ``6N``: decoder linears plus the output projection (whether or not it is tied); of a
        mixture-of-experts layer the router, the shared experts and the ``top-k`` routed experts a token uses
        (the active weights, not all the experts).

        The embedding lookup and the norms do no matmuls; torchtitan counts ``params - embedding`` (which
        keeps the norms, 0.003% of an 8B model).
        """
        return self.num_layers * self.layer_active_matmul_params + self.vocab_size * self.hidden_size

    def default_lora_targets(self) -> tuple[str, ...]:
        """What :func:`lightning_plugins.adapters.lora.apply_lora` adapts when ``target_modules`` is ``None``: the
        family's column- and row-parallel projections (``q/k/v/o_proj``, ``gate/up/down_proj``)."""
        return self.lora_targets or tuple(name for name, _, _ in self.linears)

    def lora_params_per_layer(self, target_modules: tuple[str, ...] | None, r: int) -> float:
        """Adapter parameters of one decoder layer: ``r x (in + out)`` per targeted linear (of a stack of mixed
        layers, the mean layer's: Qwen3.5's ``q_proj`` is in one layer of four).

        Args:
            target_modules: Last name components (``"q_proj"``); ``None`` takes :meth:`default_lora_targets`.
            r: The adapter rank.

        Raises:
            PlannerError: for a target that names no linear of the decoder layer.
        """
        targets = tuple(target_modules) if target_modules is not None else self.default_lora_targets()
        names = {name for name, _, _ in self.linears}
        missing = [t for t in targets if t.rpartition(".")[2] not in names]
        if missing:
            raise PlannerError(
                f"lora target_modules {missing} name no linear layer of a {self.model_type} decoder layer; its linears"
                f" are {sorted(names)}. Use some of those (e.g. target_modules=['q_proj', 'v_proj'])."
            )
        wanted = {t.rpartition(".")[2] for t in targets}
        if self.layer_kinds:
            per_kind = (k.count * sum(r * (i + o) for name, i, o in k.linears if name in wanted) for k in self.layer_kinds)  # fmt: skip
            return sum(per_kind) / self.num_layers
        return sum(r * (fan_in + fan_out) for name, fan_in, fan_out in self.linears if name in wanted)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs of attention scores and weighted values, all layers: ``4 x L x heads x head_dim x s``.

        ``QK^T`` and ``PV`` each cost ``2 x s x heads x head_dim`` per token: the whole ``s x s`` square, the
        convention torchtitan's MFU (``12 * l * h * q * t`` for forward and backward) and PaLM use. The causal
        half a flash kernel actually computes is not halved out. A layer with a sliding window ``w`` counts
        ``min(w, s)`` keys per query instead of ``s`` (the band its kernel computes; Gemma 2/3, gpt-oss, Mistral's
        windowed configs), so a windowed model's step time and MFU follow the work it does.
        """
        keys = sum(min(w, seq_len) if w else seq_len for w in self.attention_windows)
        keys += (self.num_layers - len(self.attention_windows)) * seq_len
        return 4.0 * self.num_heads * self.head_dim * keys

    def flops_per_token(self, seq_len: int, *, trainable: str = "full", adapter_params: int = 0) -> float:
        """Model FLOPs of one training token (forward and backward), without recomputation.

        Convention (torchtitan's, used for its published MFU): forward ``2N`` for the matmuls
        (``N`` = :attr:`matmul_params`) plus :meth:`attention_flops_per_token`; backward twice the
        forward. For a full fine-tune that is ``6N + 12 x L x heads x head_dim x s``.

        With ``trainable="lora"`` or ``"qlora"`` the frozen base needs no weight gradients: its matmuls cost
        ``2N`` forward plus ``2N`` for the input gradients (``4N``); attention has no weights and keeps its
        full backward; the adapters add ``6`` FLOPs per adapter parameter (``adapter_params`` for the whole
        model, negligible at usual ranks). NF4 dequantisation does no model FLOPs (the step-time model
        charges it as time).

        Raises:
            PlannerError: for an unknown ``trainable`` or a non-positive ``seq_len``.
        """
        if trainable not in TRAINABLE:
            raise PlannerError(f"trainable={trainable!r} is not one of {TRAINABLE}.")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise PlannerError(f"seq_len={seq_len!r} must be a positive integer (tokens per row).")
        matmul_factor = 6.0 if trainable == "full" else 4.0
        return matmul_factor * self.matmul_params + 3.0 * self.attention_flops_per_token(seq_len) + 6.0 * adapter_params


def model_stats(config: Any) -> ModelStats:
    """The :class:`ModelStats` of a transformers causal-LM config (a ``PretrainedConfig`` or a spec for
    :func:`load_model_config`; a :class:`ModelStats` is returned as it is)."""
    if isinstance(config, ModelStats):
        return config
    if isinstance(config, (str, Path)):
        config = load_model_config(config)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(getattr(config, name, None), int):
            raise PlannerError(
                f"The model config has no integer `{name}` ({type(config).__name__}): the planner models decoder-only"
                " causal LMs described by a transformers config.json (Llama, Mistral, Qwen and alike)."
            )
    if getattr(config, "model_type", None) in _CLOSED_FORM:
        return _closed_form(config)
    return _from_meta_layer(config)


#: Attention-projection biases per family: (q/k/v, o). Llama/Mistral-style configs name them with
#: ``attention_bias``; Qwen2 always has q/k/v biases and no o bias.
_CLOSED_FORM = ("llama", "mistral", "qwen2", "qwen3")


def _shape(config: Any) -> tuple[int, int, int, int, int, int, int]:
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "moe_intermediate_size", None) or 0
    return h, layers, heads, kv_heads, head_dim, ffn, config.vocab_size


#: Tokens per chunk of the chunked gated delta rule (transformers' torch fallback and fla's kernels): a
#: linear-attention layer attends like softmax within its chunk and carries a state across chunks, so its work per
#: token is that of a window of this many keys (the state's update is of the same order), not of the whole row.
LINEAR_ATTENTION_CHUNK = 64


def attention_windows(config: Any) -> tuple[int, ...]:
    """Per decoder layer, its sliding window (``0``: full attention), as transformers' masks decide it: a config
    with ``layer_types`` windows its ``"sliding_attention"`` layers (and counts a ``"linear_attention"`` layer as a
    window of :data:`LINEAR_ATTENTION_CHUNK`); one without windows every layer when it sets ``sliding_window``
    (Mistral). Empty when no layer is windowed."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        sizes = {"sliding_attention": window, "linear_attention": LINEAR_ATTENTION_CHUNK}
        windows = tuple(sizes.get(kind, 0) for kind in layer_types)
    else:
        windows = (window,) * config.num_hidden_layers
    return windows if any(windows) else ()


def attention_variants(config: Any) -> tuple[str, ...]:
    """The model's attention variants that decide its kernel: soft-capping (Gemma 2's ``attn_logit_softcapping``),
    sinks (gpt-oss), linear-attention layers (``layer_types``)."""
    variants = []
    if getattr(config, "attn_logit_softcapping", None):
        variants.append("softcap")
    if getattr(config, "model_type", "") == "gpt_oss":
        variants.append("sinks")
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        variants.append("linear")
    return tuple(variants)


def _stats(config: Any, **counts: Any) -> ModelStats:
    """:class:`ModelStats` with the shape read from ``config`` and the parameter ``counts`` found either way."""
    h, layers, heads, kv_heads, head_dim, ffn, vocab = _shape(config)
    return ModelStats(
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=ffn,
        vocab_size=vocab,
        model_type=str(config.model_type),
        attention_windows=attention_windows(config),
        attention_variants=attention_variants(config),
        **counts,
    )


def _closed_form(config: Any) -> ModelStats:
    from lightning_plugins.parallel.families import FAMILIES, projection_names

    h, _, heads, kv_heads, head_dim, ffn, vocab = _shape(config)
    q, kv = heads * head_dim, kv_heads * head_dim
    linears = (
        ("q_proj", h, q),
        ("k_proj", h, kv),
        ("v_proj", h, kv),
        ("o_proj", q, h),
        ("gate_proj", h, ffn),
        ("up_proj", h, ffn),
        ("down_proj", ffn, h),
    )
    if config.model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif config.model_type == "mistral":
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False)) if config.model_type == "llama" else False
    biases = (q + 2 * kv) * qkv_bias + h * o_bias + (2 * ffn + h) * mlp_bias
    head_norms = 2 * head_dim if config.model_type == "qwen3" else 0
    layer = sum(i * o for _, i, o in linears) + biases + 2 * h + head_norms
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return _stats(
        config,
        tied_embeddings=tied,
        embedding_params=vocab * h,
        layer_params=layer,
        norm_params=h,
        head_params=0 if tied else vocab * h,
        linears=linears,
        lora_targets=projection_names(FAMILIES[config.model_type]),
    )


#: Model stats counted on meta-device models, by the config's JSON text (the layout search asks for them often).
_COUNTED: dict[str, ModelStats] = {}


def _from_meta_layer(config: Any) -> ModelStats:
    """Count an unregistered model type on its meta-device copy (shapes only, no memory): every decoder layer, grouped
    by kind (:func:`.layer_kinds.layer_kinds`), so a stack that mixes kinds is counted exactly."""
    key = config.to_json_string(use_diff=False)
    if key not in _COUNTED:
        _COUNTED[key] = _counted(config)
    return _COUNTED[key]


def _built(config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as err:
        try:  # an image-text checkpoint's language model, which transformers builds only inside the whole model
            with torch.device("meta"):
                return _language_model_with_head(config)
        except (ValueError, KeyError):
            pass
        raise PlannerError(
            f"Cannot build a {getattr(config, 'model_type', '?')} causal LM from this config ({err}). The planner needs"
            " a decoder-only model transformers can build with AutoModelForCausalLM."
        ) from None


def _language_model_with_head(config: Any) -> Any:
    """The causal LM an image-text checkpoint's text config describes where transformers has no causal-LM class for it
    (Qwen2.5-VL's and Qwen3-VL's language models): its base model (``AutoModel``) and the output head, tied to the
    embedding when the config says so."""
    from torch import nn
    from transformers import AutoModel

    class LanguageModelWithHead(nn.Module):
        base_model_prefix = "model"

        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.model = AutoModel.from_config(config)
            self._no_split_modules = getattr(self.model, "_no_split_modules", None)
            tied = getattr(config, "tie_word_embeddings", False)
            self.lm_head = None if tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        def get_input_embeddings(self) -> nn.Module:
            return self.model.get_input_embeddings()

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head if self.lm_head is not None else self.get_input_embeddings()

    return LanguageModelWithHead()


def _counted(config: Any) -> ModelStats:
    from lightning_plugins.errors import LayoutError
    from lightning_plugins.parallel.families import decoder_layers, family_for, projection_names
    from lightning_plugins.parallel.moe.experts import num_experts
    from lightning_plugins.planner.layer_kinds import layer_kinds

    model = _built(config)
    try:  # LoRA's defaults: a registered family's projections, or those of the config's TP plan
        targets = projection_names(family_for(model))
    except LayoutError:
        targets = ()
    layers = list(decoder_layers(model, family_for(model, tensor_parallel=False)))
    kinds = layer_kinds(layers)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    stack = sum(k.count * k.params for k in kinds)
    embedding_params = embedding.weight.numel()
    head_params = 0 if tied or head is None else sum(p.numel() for p in head.parameters())
    mixed = len(kinds) > 1
    linears = tuple({name: (name, i, o) for k in kinds for name, i, o in k.linears}.values())
    moe = {}
    if any(k.expert_params for k in kinds):
        top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "experts_per_token", None)
        moe = {
            "num_experts": num_experts(config) or 0,
            "experts_per_token": int(top_k or 0),
            "expert_params": sum(k.count * k.expert_params for k in kinds) // len(layers),
            "expert_matmul_params": sum(k.count * k.expert_matmul_params for k in kinds) // len(layers),
        }
    return _stats(
        config,
        tied_embeddings=tied,
        embedding_params=embedding_params,
        layer_params=round(stack / len(layers)),
        norm_params=sum(p.numel() for p in model.parameters()) - embedding_params - stack - head_params,
        head_params=head_params,
        linears=linears,
        lora_targets=targets,
        layer_kinds=kinds if mixed else (),
        **moe,
    )


#: Bytes per element of an NF4 weight: 4-bit codes, an int8 absmax per 64-element block and a bf16 factor per
#: 256 blocks (:func:`lightning_plugins.adapters.qlora.nf4_nbytes_for` without its constant 34 bytes per tensor).
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 2 / (64 * 256)
