"""The checks a valid recipe passes before it runs on *this* machine, before any process starts.

:func:`~lightning_plugins.recipe.schema.load_recipe` checks what holds anywhere (keys, types, the layout against the world
and the model config), so ``plan`` and ``--print-config`` can check a recipe for a GPU cluster on a laptop. What
depends on the machine the run starts on is checked here, by both doors, once the recipe is loaded: a GPU recipe
without a GPU, flash attention on CPU, a model that is neither a local directory nor in the local Hugging Face cache
while offline, a damaged weight file, an output directory that cannot be written, a logger whose package is not
installed. Each is one :class:`RecipeError` naming the thing and the fix.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import torch

from lightning_plugins.recipe.checks import near_directories
from lightning_plugins.recipe.schema import Recipe
from lightning_plugins.errors import RecipeError
from lightning_plugins.recipe.record import LOGGER_PACKAGES

_TRUE = {"1", "on", "yes", "true"}


def check_here(recipe: Recipe, path: str | Path) -> None:
    """Refuse a recipe this machine cannot run, naming why and what to change.

    Args:
        recipe: A recipe from :func:`~lightning_plugins.recipe.schema.load_recipe`.
        path: Its file, named in the errors.

    Raises:
        RecipeError: for ``hardware.accelerator: gpu`` without a usable GPU, flash attention on CPU processes, a
            ``model.path`` that is neither a directory nor cached while the Hub cannot be reached, a weight file of
            ``model.path`` that is truncated or damaged, a ``train.output_dir`` that cannot be written, or a
            ``train.loggers`` entry whose package is not installed.
    """
    _check_accelerator(recipe, path)
    _check_attention(recipe, path)
    _check_model(recipe, Path(path))
    _check_output_dir(recipe, path)
    _check_loggers(recipe, path)


def _check_accelerator(recipe: Recipe, path: str | Path) -> None:
    if recipe.hardware.accelerator == "gpu" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        raise RecipeError(
            f"{path}: hardware.accelerator: gpu, but this machine has no GPU torch can use (torch {torch.__version__},"
            f" built for {build}). Set hardware.accelerator: cpu (--hardware.accelerator=cpu) to run on CPU processes,"
            " or run it on a machine with GPUs."
        )


def _check_attention(recipe: Recipe, path: str | Path) -> None:
    """Flash attention (``flash_attention_2/3``, packed rows' variable-length kernel included) runs on CUDA only."""
    from lightning_plugins.data.packing import VARLEN_ATTENTION

    implementation = recipe.model.attn_implementation
    if implementation not in VARLEN_ATTENTION or recipe.hardware.device_type() == "cuda":
        return
    where = "hardware.accelerator: cpu" if recipe.hardware.accelerator == "cpu" else "no GPU torch can use here"
    packed = " (data.packing keeps the samples apart by a block-diagonal mask)" if recipe.data.packing else ""
    raise RecipeError(
        f"{path}: model.attn_implementation: {implementation} runs on CUDA GPUs only (flash-attn), and this run is on"
        f" CPU processes ({where}). Set model.attn_implementation: sdpa (--model.attn_implementation=sdpa){packed}."
    )


def _check_model(recipe: Recipe, path: Path) -> None:
    model = Path(recipe.model.path)
    if model.is_dir():
        _check_weights(model, path)
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(recipe.model.path, "config.json"), str) or not _offline():
        return  # cached, or the Hub is reachable: transformers downloads it (or says it has no such repository)
    base = path.resolve().parent
    hint = near_directories(recipe.model.path, base)
    raise RecipeError(
        f"{path}: model.path={recipe.model.path!r} is no directory (relative to {base} or the current directory) and"
        f" not in the local Hugging Face cache, and the Hub cannot be reached (offline).{hint} Give a local HF"
        " checkpoint directory, or download the model first (`hf download <id>` where there is network)."
    )


def _offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set, or the Hub's host cannot be reached within 3 s."""
    if any(os.environ.get(key, "").lower() in _TRUE for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return True
    return False


def _check_weights(model: Path, path: Path) -> None:
    """Every safetensors file of ``model`` is whole: its header parses and its tensors end where the file does."""
    from lightning_plugins.checkpoint.load import checkpoint_index
    from lightning_plugins.checkpoint.safetensors_io import read_header

    if (model / "model.safetensors.index.json").is_file():
        try:
            checkpoint_index(model)  # the index parses and every shard it names is there
        except (ValueError, FileNotFoundError) as err:
            raise RecipeError(f"{path}: model.path={model}: {err}") from None
    for file in sorted(model.glob("*.safetensors")):
        try:
            header, data_start = read_header(file)
            end = data_start + max((entry["data_offsets"][1] for entry in header.values()), default=0)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise RecipeError(
                f"{path}: model.path={model}: weight file {file.name} is damaged ({err}). Copy the model again."
            ) from None
        size = file.stat().st_size
        if size != end:
            raise RecipeError(
                f"{path}: model.path={model}: weight file {file.name} is damaged: its header says {end} bytes, the"
                f" file has {size} ({'truncated' if size < end else 'extra bytes'}). Copy the model again."
            )


def _check_output_dir(recipe: Recipe, path: str | Path) -> None:
    out = Path(recipe.train.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as err:
        raise RecipeError(
            f"{path}: train.output_dir={str(out)!r} cannot be written ({err.strerror or err}). Checkpoints, metrics"
            " and the exported model go there: choose a writable directory (--train.output_dir=...)."
        ) from None


def _check_loggers(recipe: Recipe, path: str | Path) -> None:
    for name in recipe.train.loggers:
        module, dist = LOGGER_PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise RecipeError(
                f"{path}: train.loggers names {name}, whose package {dist} is not installed here: install it (pip"
                f' install "lightning_plugins[loggers]", or pip install {dist}) or drop {name} from train.loggers.'
            )
