"""Any recipe at tiny width and depth on CPU processes: ``lightning-plugins tiny RECIPE [--out DIR]``.

A real-size recipe (a 70B on 32 GPUs, say) cannot run here, but everything about it except the sizes can: the
same model family (its own ``config.json``, shrunk), the same kinds of layout (each parallel dimension the
recipe uses kept at 2 ranks, within 4 CPU processes), the same method (full, LoRA, QLoRA), memory levers,
data format and packing, optimizer and schedule. :func:`shrink_recipe` writes such a tiny twin next to a
randomly initialised checkpoint of the shrunk config (the shipped tiny tokenizer and data) and returns the
recipe file, which both doors run as they would the original. The tests smoke-test every shipped recipe so.

What changes, and why: widths and depths (fit a CPU), fp32 everywhere (CPU has no bf16 mixed precision),
``hardware`` (CPU processes), the batch (a few short rows), the learning rate (a random tiny model learns at a
larger one), and the schedule (a few steps). Nothing else.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_plugins.data.tiny import tiny_assets
from lightning_plugins.parallel.layout import ParallelLayout
from lightning_plugins.parallel.pipeline import PipelineOptions
from lightning_plugins.recipe.schema import Recipe, apply_override, load_recipe
from lightning_plugins.recipe.tiny_image_text import (
    TINY_VLM_SEQ_LEN,
    tiny_image_text_config,
    tiny_image_text_data,
    write_image_text_model,
)
from lightning_plugins.errors import RecipeError

#: CPU processes at most: each parallel dimension of the recipe is kept at 2 ranks within this world.
MAX_TINY_WORLD = 4
#: Order in which dimensions are dropped when they do not all fit :data:`MAX_TINY_WORLD` (data first).
_DROP_ORDER = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "pp_size")
#: The shrunk model: as the shipped tiny Llama, with heads that still split over TP=2 x Ulysses CP=2.
TINY_DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8, "head_dim": 16}
#: A mixture-of-experts model shrunk: 4 routed experts, 2 per token (expert parallelism of 2 splits them 2 + 2),
#: small experts; the keys are each family's spelling (the ones the config has are set).
TINY_MOE = {
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "n_routed_experts": 4,  # DeepSeek-V3 / GLM-4.5 spelling, with their expert groups (one group of 4)
    "n_group": 1,
    "topk_group": 1,
}
#: The other widths a family has, shrunk where its config has them so that heads still split over TP=2: Gated
#: DeltaNet linear attention (Qwen3.5, Qwen3-Next) and multi-head latent attention (DeepSeek-V3, Kimi K2).
TINY_WIDTHS = {
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
#: Learning rates at which a random tiny model's loss falls within a few steps (full, adapters).
TINY_LR = {"full": 3e-3, "lora": 1e-2}
TINY_SEQ_LEN = 64
TINY_MICRO_BATCH = 4
#: Records of the tiny data a twin trains and evaluates on (the first ones of the shipped files).
TINY_RECORDS = {"train": 1024, "eval": 32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tiny_layout(layout: ParallelLayout) -> ParallelLayout:
    """The recipe's layout at 2 ranks per dimension it uses, dropping data, then TP, CP, PP beyond 4 processes.

    FSDP8 becomes FSDP2; TP8 x FSDP4 becomes TP2 x FSDP2; TP8 x PP4 x FSDP8 becomes TP2 x PP2; one process stays
    one process. No more processes than the kinds need: on a few CPU cores every extra rank slows every step.
    """
    used = {name: 2 for name in _DROP_ORDER if getattr(layout, name) > 1}
    for name in _DROP_ORDER:
        if _product(used) <= MAX_TINY_WORLD:
            break
        used.pop(name, None)
    # Expert parallelism adds no rank: it splits the experts over 2 of the data or context ranks that are kept.
    experts = 2 if layout.ep_size > 1 and ("dp_shard_size" in used or "cp_size" in used) else 1
    return ParallelLayout(**{name: used.get(name, 1) for name in _DROP_ORDER}, ep_size=experts)


def _product(sizes: dict[str, int]) -> int:
    total = 1
    for size in sizes.values():
        total *= size
    return total


def tiny_config(config: Any, layers: int) -> Any:
    """``config`` (any HF causal LM config) shrunk to :data:`TINY_DIMS` and ``layers`` layers, with the tiny
    tokenizer's vocabulary and special tokens; the family, activation, norms, RoPE settings, biases and tying
    are the original's."""
    tokenizer = _tiny_tokenizer()
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    changes: dict[str, Any] = {
        **TINY_DIMS,
        "num_key_value_heads": TINY_DIMS["num_attention_heads"] // (2 if kv_heads < config.num_attention_heads else 1),
        "num_hidden_layers": layers,
        "vocab_size": 64,  # the tiny tokenizer's 50 tokens, padded to a multiple of 8 (TP, loss parallel)
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "torch_dtype": "float32",
    }
    if getattr(config, "max_window_layers", None) is not None:
        changes["max_window_layers"] = layers
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):  # an alternating pattern (gpt-oss: sliding, full) is kept, as is a uniform one
        changes["layer_types"] = _every_kind(layer_types, layers)
    if getattr(config, "first_k_dense_replace", None):  # DeepSeek-V3 / GLM-4.5: one dense layer, then experts
        changes["first_k_dense_replace"] = 1
    changes.update({key: value for key, value in TINY_WIDTHS.items() if getattr(config, key, None) is not None})
    if "qk_rope_head_dim" in changes:  # latent attention: RoPE's width is head_dim (as DeepseekV3Config sets it)
        changes["head_dim"] = changes["qk_rope_head_dim"]
    if isinstance(getattr(config, "sliding_window", None), int):  # a window the tiny rows are longer than
        changes["sliding_window"] = min(config.sliding_window, TINY_SEQ_LEN // 4)
    changes.update({key: value for key, value in TINY_MOE.items() if getattr(config, key, None) is not None})
    fields = {**config.to_dict(), **changes}
    fields.pop("quantization_config", None)  # the twin's random weights are plain fp32 (gpt-oss ships MXFP4 experts)
    return type(config).from_dict(fields)


def _every_kind(layer_types: list[str], layers: int) -> list[str]:
    """The first ``layers`` of a periodic ``layer_types``, its last entries given to the kinds those leave out: a
    twin of Qwen3.5 (three linear-attention layers to one full) has one of each, as gpt-oss's keeps sliding, full."""
    kinds = [layer_types[i % len(layer_types)] for i in range(layers)]
    missing = [kind for kind in dict.fromkeys(layer_types) if kind not in kinds]
    for index, kind in zip(range(layers - 1, 0, -1), missing):
        kinds[index] = kind
    return kinds


def _tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets().model_dir)


def shrink_recipe(path: str | Path, out_dir: str | Path, *, steps: int = 20, overrides: tuple[str, ...] = ()) -> Path:
    """Write the tiny twin of the recipe at ``path`` into ``out_dir`` and return its recipe file.

    ``out_dir`` receives ``recipe.yaml`` (the original's sections with the changes of the module docstring),
    ``model/`` (a random checkpoint of the shrunk config with the tiny tokenizer) and, when the recipe runs,
    ``run/`` (its outputs). The original is loaded and checked at its real size first (``overrides`` apply to
    it), so a recipe that is wrong at real size is refused here too.

    Raises:
        RecipeError: for a recipe that does not validate, naming the file and the key.
    """
    from lightning_plugins.planner.model_stats import load_model_config
    from lightning_plugins.errors import PlannerError

    path, out = Path(path), Path(out_dir)
    recipe = load_recipe(path, overrides)
    images = recipe.data.format == "image_text"
    try:
        config = load_model_config(recipe.model.path, multimodal=images)
    except PlannerError as err:
        raise RecipeError(f"{path}: model.path: {err}") from None
    if images:  # the whole image-text model, its processor and images (recipe/tiny_image_text.py)
        config = tiny_image_text_config(config, tiny_config(config.text_config, 2), path)
    layout = tiny_layout(recipe.layout)
    stages = layout.pp_size * (
        PipelineOptions.of(recipe.parallel).resolve(layout.pp_size).stages_per_rank if layout.pp_size > 1 else 1
    )
    out.mkdir(parents=True, exist_ok=True)
    if images:
        write_image_text_model(config, out / "model", recipe.train.seed)
    else:
        _write_model(tiny_config(config, max(2, stages)), out / "model", recipe.train.seed)
    raw = yaml.safe_load(path.read_text())
    for override in overrides:  # the user's overrides, then the twin's own settings
        apply_override(raw, override, path)
    _apply(raw, _tiny_settings(recipe, layout, steps, out))
    target = out / "recipe.yaml"
    header = f"# The tiny twin of {path} (lightning-plugins tiny): same family, layout kinds, method and levers.\n"
    target.write_text(header + yaml.safe_dump(raw, sort_keys=False))
    load_recipe(target)  # the twin validates as the original did
    return target


def _write_model(config: Any, directory: Path, seed: int) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # a one-file checkpoint: no bar
    try:
        # transformers' own layout (fused 3-D experts), not the hub's per-expert tensors it converts back to by
        # default: the doors' sharded loader reads the former (dense models are saved the same either way).
        model.save_pretrained(directory, save_original_format=False)
    finally:
        if bars:
            logging.enable_progress_bar()
    for name in _TOKENIZER_FILES:
        shutil.copy(tiny_assets().model_dir / name, directory / name)


def _tiny_settings(recipe: Recipe, layout: ParallelLayout, steps: int, out: Path) -> dict[str, Any]:
    """Dotted keys and the values the tiny twin sets (everything else is the original's)."""
    world = layout.tp_size * layout.pp_size * layout.cp_size * max(1, layout.dp_shard_size) * layout.dp_replicate_size
    micro = max(recipe.train.micro_batch_size, TINY_MICRO_BATCH)  # a few rows: a loss that falls step on step
    if layout.pp_size > 1:  # what the pipeline splits: a multiple of its micro-batches
        pieces = PipelineOptions.of(recipe.parallel).resolve(layout.pp_size).microbatches
        micro = -(-micro // pieces) * pieces
    dp = max(1, layout.dp_shard_size) * layout.dp_replicate_size
    settings: dict[str, Any] = {
        "model.path": str((out / "model").resolve()),
        "model.dtype": "fp32",
        # eager stays eager (gpt-oss: attention sinks, no SDPA in transformers); a GPU kernel becomes SDPA on CPU
        "model.attn_implementation": "eager" if recipe.model.attn_implementation == "eager" else "sdpa",
        "data.train": str(_tiny_rows(recipe, "train", out)),
        "data.eval": str(_tiny_rows(recipe, "eval", out)),
        "data.eval_fraction": 0.0,
        "data.max_seq_len": TINY_VLM_SEQ_LEN if recipe.data.format == "image_text" else TINY_SEQ_LEN,
        "layout": {
            name: getattr(layout, name)
            for name in ("tp_size", "pp_size", "cp_size", "dp_shard_size", "dp_replicate_size", "ep_size")
        },
        "memory.param_dtype": None,
        "memory.reduce_dtype": None,
        # Resharding pipeline stages needs FSDP2 stages: kept where the twin keeps a data or context rank.
        "memory.pp_reshard_per_microbatch": recipe.memory.pp_reshard_per_microbatch
        and layout.pp_size > 1
        and dp * layout.cp_size > 1,
        "optim.lr": TINY_LR["full" if recipe.lora is None else "lora"],
        "optim.warmup_steps": min(recipe.optim.warmup_steps, 1),
        "train.global_batch_size": micro * dp * min(recipe.accumulation, 2),
        "train.global_batch_tokens": None,
        "train.micro_batch_size": micro,
        "train.max_steps": steps,
        "train.epochs": None,
        "train.eval_every": steps,
        "train.checkpoint_every": None,
        "train.log_every": 1,
        "train.profile": None,  # a real recipe's window lies past the tiny twin's steps
        "train.output_dir": str((out / "run").resolve()),
        "hardware": {"accelerator": "cpu", "devices": world, "nodes": 1},
    }
    return settings


def _tiny_rows(recipe: Recipe, split: str, out: Path) -> Path:
    """The twin's ``split`` file under ``out/data``: the first :data:`TINY_RECORDS` records of the shipped tiny data."""
    if recipe.data.format == "image_text":
        return tiny_image_text_data(split, TINY_RECORDS[split], out)
    return _head(_tiny_data(recipe, split), out, split)


def _tiny_data(recipe: Recipe, split: str) -> Path:
    """The shipped tiny data a twin trains on: reversal pairs for a preference method (unpaired for KTO), chat records
    for chat, else prompt/completion records."""
    assets = tiny_assets()
    if recipe.objective.paired:
        return assets.root / "data" / f"preference_{split}.jsonl"
    if recipe.objective.unpaired:
        return assets.root / "data" / f"kto_{split}.jsonl"
    if recipe.data.format == "chat":
        return assets.chat_train_file if split == "train" else assets.chat_eval_file
    return assets.train_file if split == "train" else assets.eval_file


def _head(source: Path, out: Path, split: str) -> Path:
    """The first :data:`TINY_RECORDS` records of a tiny data file, written under ``out/data``."""
    target = out / "data" / f"{split}.jsonl"
    target.parent.mkdir(exist_ok=True)
    with open(source) as lines:
        target.write_text("".join(line for _, line in zip(range(TINY_RECORDS[split]), lines)))
    return target.resolve()


def _apply(raw: dict[str, Any], settings: dict[str, Any]) -> None:
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
