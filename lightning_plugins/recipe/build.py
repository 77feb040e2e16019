"""What both doors do with a recipe, framework-free: build the model, the data, the optimizer and its schedule.

The Lightning door (:mod:`lightning_plugins.strategies.runner`) and the Accelerate door call these, so a recipe
trains the same way through either.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_plugins.parallel.dtypes import DTYPES
from lightning_plugins.parallel.optim.offload import offload_optimizer
from lightning_plugins.parallel.optim.optim_in_backward import step_in_backward
from lightning_plugins.parallel.optim.optimizers import optimizer_class
from lightning_plugins.planner.hardware import peak_flops
from lightning_plugins.recipe.schema import Recipe
from lightning_plugins.checkpoint.resume import ResumableDataLoader, loader_generator



def lr_lambda(step: int, total: int, warmup: int, scheduler: str, min_ratio: float) -> float:
    """The learning-rate multiplier at optimizer step ``step``: linear warmup, then the decay."""
    if step < warmup:
        return (step + 1) / warmup
    if scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if scheduler == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * decay


def make_optimizer(model: torch.nn.Module, recipe: Recipe, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (``optim.name``: torch's, or torchao's 8-bit one) over the trainable parameters only (LoRA: the
    adapters) and its per-step schedule.

    With ``memory.optimizer_offload`` the AdamW state and step live in host memory
    (:class:`lightning_plugins.parallel.optim.offload.HostOffloadOptimizer`); the schedule drives it the same way.
    """
    optim = recipe.optim
    trainable = [p for p in model.parameters() if p.requires_grad]
    hyperparameters = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}
    adamw = optimizer_class(optim.name)
    if recipe.memory.optimizer_offload:
        optimizer: torch.optim.Optimizer = offload_optimizer(adamw, trainable, **hyperparameters)
    else:
        optimizer = adamw(trainable, **hyperparameters)
    if recipe.memory.optimizer_in_backward:  # the Accelerate door hooks the prepared (sharded) parameters itself
        step_in_backward(optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, total_steps, optim.warmup_steps, optim.scheduler, optim.min_lr_ratio)
    )
    return optimizer, schedule


def build_model(recipe: Recipe, *, on_meta: bool = True) -> tuple[torch.nn.Module, Any]:
    """The tokenizer and the model to train, on the meta device: each rank reads only its slices of the checkpoint
    once the door has applied the layout (:func:`~lightning_plugins.checkpoint.load.parallelize_and_load`).

    Every path takes it: a local directory or a hub id (its snapshot, fetched once per node,
    :func:`~lightning_plugins.checkpoint.snapshot.local_checkpoint`), a full fine-tune, LoRA (the adapters built real,
    the base on meta) and QLoRA (NF4 weights of the right sizes, quantized by each rank as it loads), the text decoder
    of a multimodal checkpoint. ``on_meta=False`` loads the weights whole instead, as DeepSpeed and Accelerate's own
    FSDP expect.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lightning_plugins.checkpoint.load import load_sharded_safetensors
    from lightning_plugins.checkpoint.snapshot import local_checkpoint
    from lightning_plugins.checkpoint.text_tower import is_multimodal, text_config
    from lightning_plugins.data import prepare_model_for_packing

    from lightning_plugins.data.image_dataset import is_image_text_data

    spec = recipe.model
    remote = {"trust_remote_code": spec.trust_remote_code}  # off unless the recipe says so
    path = local_checkpoint(spec.path, **remote)
    kwargs = {"dtype": DTYPES[spec.dtype], "attn_implementation": spec.attn_implementation}
    if is_image_text_data(recipe.data):  # the whole image-text model and its processor (in place of a tokenizer)
        from lightning_plugins.recipe.image_text import build_image_text_model

        return build_image_text_model(recipe, path, kwargs, on_meta)
    tokenizer = AutoTokenizer.from_pretrained(path, **remote)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(path, **remote)
    if on_meta or is_multimodal(config):  # Gemma 3 27B: train the text decoder, read from the multimodal checkpoint
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text_config(config), **kwargs, **remote)
        if not on_meta:
            load_sharded_safetensors(model, path)
    else:
        from lightning_plugins.checkpoint.mxfp4 import dequantized

        kwargs.update(dequantized(config))  # MXFP4 experts (gpt-oss) load dense, to train
        model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs, **remote)
    model.train()  # from_pretrained returns eval mode: dropout (LoRA's too) would be off
    model.config.use_cache = False  # training: no KV cache (it would also grow under recomputation)
    if recipe.data.packing and recipe.layout.cp_size == 1:  # under CP, its attention keeps the documents apart itself
        prepare_model_for_packing(model, varlen=varlen_packing(recipe), device=recipe.hardware.device_type())
    if recipe.lora is not None:
        from lightning_plugins.adapters.lora import apply_lora

        torch.manual_seed(recipe.train.seed)  # identical adapters on every rank
        model = apply_lora(model, recipe.lora)
    return model, tokenizer


def varlen_packing(recipe: Recipe) -> bool:
    """Whether packed rows go to flash attention's variable-length kernel: ``data.packing`` with
    ``model.attn_implementation`` flash_attention_2/3 and no context parallelism (whose attention keeps the documents
    apart itself). The batches then carry each sample's length (``cu_seq_lens``, ``make_collator(..., varlen=True)``)
    and the model takes them (``prepare_model_for_packing(model, varlen=True)``), on CUDA only: the preflight refuses
    it on CPU. Under pipeline parallelism the batches carry no lengths: each stage finds its micro-batch's from the
    ``position_ids`` (:func:`~lightning_plugins.parallel.pipeline.stage.packed_lengths`)."""
    from lightning_plugins.data.packing import VARLEN_ATTENTION

    flash = recipe.model.attn_implementation in VARLEN_ATTENTION
    return bool(recipe.data.packing) and flash and recipe.layout.cp_size == 1


def objective_data(recipe: Recipe) -> Any:
    """The data section as the objective reads it: ``data.format: auto`` under a preference method is the method's
    own format (pairs for dpo/simpo/orpo, unpaired records for kto), so records of the other kind fail as they are
    read, naming file and line (:func:`~lightning_plugins.data.build_dataset`)."""
    import dataclasses

    data = recipe.data
    if data.format != "auto" or recipe.objective.method == "sft":
        return data
    return dataclasses.replace(data, format="unpaired" if recipe.objective.unpaired else "preference")


def build_loaders(recipe: Recipe, tokenizer: Any) -> tuple[ResumableDataLoader, DataLoader | None]:
    """Training and held-out loaders; pipelines get fixed-length batches (stages are built per shape).

    The training loader resumes mid-epoch (:class:`~lightning_plugins.checkpoint.resume.ResumableDataLoader`); both
    draw from their own generators, never from the global random state (see :mod:`lightning_plugins.checkpoint.resume`).
    With ``objective.reference: precomputed`` each example carries its row number
    (:func:`~lightning_plugins.preference.precomputed.numbered`), which the objective turns into the reference's
    log-probabilities of its rows.
    """
    from lightning_plugins.data import build_dataset, make_collator
    from lightning_plugins.data.image_dataset import build_image_text_dataset, is_image_text_data
    from lightning_plugins.preference.precomputed import numbered
    from lightning_plugins.recipe.image_text import image_text_collate

    data = objective_data(recipe)
    fixed = data.max_seq_len if recipe.layout.pp_size > 1 else None
    build, collate = build_dataset, None
    if is_image_text_data(data):  # `tokenizer` is the model's processor
        build, collate = build_image_text_dataset, image_text_collate(recipe, tokenizer)
    # Flash attention's packed rows: each sample's length in the batch; a pipeline's stages find each micro-batch's.
    varlen = varlen_packing(recipe) and recipe.layout.pp_size == 1
    collate = collate or make_collator(data, tokenizer.pad_token_id, pad_to_multiple_of=fixed, varlen=varlen)
    size = recipe.train.micro_batch_size
    # A pipeline splits every batch into its micro-batches: a short last training batch would not split, so it is
    # dropped; evaluation takes every sample (the pipeline tops a short batch up with rows that hold no target).
    drop = recipe.layout.pp_size > 1
    seed = recipe.train.seed
    dataset = build(data, tokenizer, "train")
    check_objective_data(recipe, dataset.column_names)
    check_global_batch(recipe, dataset.num_rows)
    held = build(data, tokenizer, "eval") if data.has_eval else None
    if recipe.objective.reference == "precomputed" and recipe.objective.needs_reference:
        dataset, held, collate = numbered(dataset, held, collate)
    train = ResumableDataLoader(
        dataset, batch_size=size, shuffle=True, collate_fn=collate, drop_last=drop, generator=loader_generator(seed)
    )
    if held is None:
        return train, None
    return train, DataLoader(held, batch_size=size, shuffle=False, collate_fn=collate, generator=loader_generator(seed))


def make_objective(recipe: Recipe, train: DataLoader, held: DataLoader | None) -> Any | None:
    """The recipe's preference objective, both doors': ``None`` for SFT (the model's own loss); KTO on unpaired
    examples; a paired method, whose DPO reference with ``objective.reference: precomputed`` comes from one pass over
    ``train``'s and ``held``'s rows before training, kept next to the tokenized data for the next run with the same
    key (:class:`~lightning_plugins.preference.precomputed.PrecomputedReference`), instead of a forward per step."""
    from lightning_plugins.preference import KTOObjective, PreferenceObjective
    from lightning_plugins.preference.precomputed import PrecomputedReference

    options = recipe.objective
    if options.method == "sft":
        return None
    if options.unpaired:
        return KTOObjective(options)
    if options.reference == "precomputed" and options.needs_reference:
        from lightning_plugins.data.prepared import cache_root

        datasets = [train.dataset, None if held is None else held.dataset]
        return PrecomputedReference(PreferenceObjective(options), datasets, train.collate_fn,
                                    recipe.train.micro_batch_size, cache_root(recipe.data))  # fmt: skip
    return PreferenceObjective(options)


def check_objective_data(recipe: Recipe, columns: list[str]) -> None:
    """Refuse records of the wrong kind for ``objective.method``: pairs or unpaired (KTO) records for SFT
    (``data.format: auto`` decides from the columns only when the data is read); a preference method reads its own
    format (:func:`objective_data`), which refuses the other kind naming file and line."""
    from lightning_plugins.data import DataError
    from lightning_plugins.data.preference import PAIR_KEYS, UNPAIRED_KEYS

    from lightning_plugins.parallel.context.batch import SEQUENCE_IDS  # packed pairs' rows (data.packing)

    paired = PAIR_KEYS[0] in columns or SEQUENCE_IDS in columns
    kind = "pairs" if paired else "unpaired" if UNPAIRED_KEYS[0] in columns else "sft"
    want = "pairs" if recipe.objective.paired else "unpaired" if recipe.objective.unpaired else "sft"
    if kind != want:
        words = {"pairs": "chosen/rejected pairs", "unpaired": "unpaired prompt/completion/label (KTO) records",
                 "sft": "prompt/completion or chat records"}  # fmt: skip
        fix = " (or data.format: prompt_completion to train SFT on every completion)" if kind == "unpaired" else ""
        raise DataError(
            f"data.train ({recipe.data.train}) holds {words[kind]}, but objective.method={recipe.objective.method}"
            f" trains on {words[want]}. Point data.train at records of that kind{fix}, or change objective.method."
        )


def check_global_batch(recipe: Recipe, samples: int) -> None:
    """Refuse a training set smaller than one global batch: every step would train on fewer samples than it says.

    Raises:
        DataError: naming the numbers (samples, micro batch x accumulation x data-parallel ranks) and the fix.
    """
    from lightning_plugins.data import DataError
    from lightning_plugins.data.image_dataset import is_image_text_data  # image-text samples pack per drawn batch

    if samples >= recipe.samples_per_step:
        return
    per_step = recipe.train.micro_batch_size * recipe.layout.dp_size
    rows = "packed rows" if recipe.data.packing and not is_image_text_data(recipe.data) else "samples"
    dp = recipe.layout.dp_size
    if samples >= per_step:
        fix = f"Lower train.global_batch_size to {samples // per_step * per_step} (a multiple of {per_step})"
    elif samples >= dp:
        fix = f"Set train.micro_batch_size={samples // dp} and train.global_batch_size={samples // dp * dp}"
    else:
        fix = f"Use at most {samples} data-parallel ranks"
    raise DataError(
        f"data.train ({recipe.data.train}) holds {samples} training {rows} after tokenization, fewer than one"
        " global batch of"
        f" {recipe.samples_per_step} (train.micro_batch_size {recipe.train.micro_batch_size} x accumulation"
        f" {recipe.accumulation} x data-parallel ranks {dp}): every optimizer step would train on"
        f" fewer samples than the recipe says. {fix}, or add training data."
    )


def batches_per_rank(recipe: Recipe, samples: int) -> int:
    """Training batches each data-parallel rank runs per epoch: Lightning's ``DistributedSampler`` (and the
    Accelerate door's) pads the ``samples`` to a multiple of ``dp_size``; pipelines drop a short last batch."""
    per_rank = math.ceil(samples / recipe.layout.dp_size)
    size = recipe.train.micro_batch_size
    return per_rank // size if recipe.layout.pp_size > 1 else math.ceil(per_rank / size)


def total_steps(recipe: Recipe, batches_per_epoch: int) -> int:
    """Optimizer steps of the whole run: ``train.max_steps``, or the epochs' (a short last window steps too)."""
    return recipe.train.max_steps or recipe.train.epochs * math.ceil(batches_per_epoch / recipe.accumulation)


def input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens a rank runs forward for ``batch`` (padding excluded)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def model_flops_utilization(tokens_per_s: float, num_params: int, world_size: int) -> float | None:
    """MFU (6 x params FLOPs per token) against the GPUs' dense bf16 peak; ``None`` on CPU or an unknown GPU."""
    if not torch.cuda.is_available():
        return None
    peak = peak_flops(torch.cuda.get_device_name())
    return None if peak is None else 6 * num_params * tokens_per_s / (peak * world_size)
