"""A checkpoint's ``export/`` directory: what the doors record at save time besides the weights, read by export.

:func:`save_export_info` (one rank of either door, into the checkpoint being written) stores the HF config and
generation config, the tokenizer, the peft adapter configs, and ``export.json`` (where the model's weights sit in the
checkpoint's state dict, the original model's path, the adapters and which are active). The rest reads them back for
:func:`lightning_plugins.checkpoint.export.export_checkpoint`, or takes them from ``--model DIR`` when given.
"""

from __future__ import annotations

import copy
import json
import shutil
from lightning_plugins.errors import ExportError
from pathlib import Path
from typing import Any

from torch import nn

#: The sub-directory of a checkpoint where the doors keep what export needs besides the weights.
EXPORT_DIR = "export"
_INFO = "export.json"


_TOKENIZERS: dict[str, Any] = {}


def save_export_info(
    directory: str | Path, module: nn.Module, state_key: str, source: str | Path | None = None, tokenizer: Any = None
) -> None:
    """Write what export needs besides the weights into ``directory/export/`` (one rank calls it).

    Args:
        directory: The checkpoint directory being written (before it is moved into place).
        module: What the door saves (a LightningModule, or the model given to ``prepare``); its HF model is found.
        state_key: The top-level key the door saves the module's state dict under (``"state_dict"``, ``"model"``).
        source: The directory or hub id the model was loaded from (default: the config's ``name_or_path``).
        tokenizer: Saved alongside; by default the tokenizer of ``source`` when it is a local directory.
    """
    from lightning_plugins.adapters.lora import lora_layers
    from lightning_plugins.parallel.families import find_hf_model

    from lightning_plugins.errors import LayoutError

    try:
        hf = find_hf_model(module, "save_export_info")
    except LayoutError:  # not one HF model (a custom module): `export --model DIR` supplies what is missing
        return
    path = next(name for name, sub in module.named_modules() if sub is hf)
    source = str(source or hf.config.name_or_path or "")
    if source and Path(source).is_dir():
        source = str(Path(source).resolve())
    target = Path(directory) / EXPORT_DIR
    config = copy.deepcopy(hf.config)
    # A pipelined model's class is our subclass of the transformers class: record the latter.
    hf_class = next(cls for cls in type(hf).__mro__ if cls.__module__.startswith("transformers."))
    config.architectures = [hf_class.__name__]
    config.save_pretrained(target / "config")
    if getattr(hf, "generation_config", None) is not None:
        hf.generation_config.save_pretrained(target / "config")
    if tokenizer is None and source and Path(source).is_dir():
        tokenizer = _source_tokenizer(source)
    if tokenizer is not None:
        tokenizer.save_pretrained(target / "tokenizer")
    adapters, active = getattr(hf, "peft_config", {}) or {}, []
    for name, adapter_config in adapters.items():
        saved = copy.deepcopy(adapter_config)
        saved.inference_mode = True
        saved.save_pretrained(str(target / "adapters" / name))
    for _, layer in lora_layers(hf):
        active = list(layer.active_adapters)
        break
    info = {"state_prefix": f"{state_key}.{path}." if path else f"{state_key}.", "model_path": source}
    info.update(adapters=list(adapters), active_adapters=active)
    (target / _INFO).write_text(json.dumps(info, indent=1))


def _source_tokenizer(source: str) -> Any:
    """The tokenizer of a local model directory (loaded once per process), or ``None`` if it has none."""
    if source not in _TOKENIZERS:
        from transformers import AutoTokenizer

        has_files = any((Path(source) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
        _TOKENIZERS[source] = AutoTokenizer.from_pretrained(source) if has_files else None
    return _TOKENIZERS[source]


def read_export_info(ckpt: Path) -> dict[str, Any]:
    """What the checkpoint ``ckpt`` recorded for its export (``{}`` when it recorded nothing)."""
    path = ckpt / EXPORT_DIR / _INFO
    return json.loads(path.read_text()) if path.is_file() else {}


def export_config(ckpt: Path, model: str | Path | None, source: str | None) -> Any:
    """The model config an export of ``ckpt`` writes: from ``model`` when given, else the one the checkpoint recorded."""
    from transformers import AutoConfig

    recorded = ckpt / EXPORT_DIR / "config"
    where = model if model is not None else recorded if (recorded / "config.json").is_file() else source
    if where is None:
        raise ExportError(
            f"{ckpt} records no model config ({recorded}/config.json is missing): pass the original model"
            " directory with --model DIR."
        )
    try:
        return AutoConfig.from_pretrained(str(where))
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot read the model config from {where}: {err}") from None


def adapter_configs(ckpt: Path, info: dict) -> dict[str, Any]:
    """The peft config of each adapter the checkpoint ``ckpt`` holds, by adapter name."""
    from peft import PeftConfig

    root = ckpt / EXPORT_DIR / "adapters"
    names = info.get("adapters") or (sorted(p.name for p in root.iterdir()) if root.is_dir() else [])
    if not names:
        raise ExportError(
            f"{ckpt} holds LoRA weights but no adapter config ({root}/<name>/adapter_config.json): it was not written"
            " by a door of this version. Save the adapter from the model in memory (export_hf) instead."
        )
    return {name: PeftConfig.from_pretrained(str(root / name)) for name in names}


def write_config(ckpt: Path, model: str | Path | None, config: Any, directory: Path) -> None:
    """Write ``config`` (the exported model's) into ``directory``."""
    config = copy.deepcopy(config)
    config.save_pretrained(directory)
    recorded = ckpt / EXPORT_DIR / "config" / "generation_config.json"
    if model is None and recorded.is_file():
        shutil.copy(recorded, directory / recorded.name)
    elif model is not None and (Path(model) / "generation_config.json").is_file():
        shutil.copy(Path(model) / "generation_config.json", directory / "generation_config.json")


def write_tokenizer(ckpt: Path, model: str | Path | None, directory: Path) -> None:
    """Write the tokenizer (``model``'s, else the one the checkpoint recorded) into ``directory`` when there is one."""
    recorded = ckpt / EXPORT_DIR / "tokenizer"
    if model is None and recorded.is_dir():
        for path in recorded.iterdir():
            shutil.copy(path, directory / path.name)
    elif model is not None:
        tokenizer = _source_tokenizer(str(model)) if Path(model).is_dir() else None
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
