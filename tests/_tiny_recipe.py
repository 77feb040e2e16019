"""A shipped tiny recipe written to a test's directory, its model and data paths made absolute, sections changed."""

from __future__ import annotations

from pathlib import Path

import yaml

TINY = Path(__file__).parents[1] / "recipes" / "tiny"


def tiny_recipe(
    tmp_path: Path, source: Path, drop: tuple[str, ...] = (), *, cache: bool = False, **changes: dict
) -> Path:
    """``source`` with the tiny model, its own data files, ``drop``'s sections removed and ``changes``' keys set
    (``{section: {key: value}}``); ``cache`` puts the data cache under ``tmp_path``."""
    raw = yaml.safe_load(source.read_text())
    raw["model"]["path"] = str(TINY / "model")
    raw["data"].update(train=str(TINY / raw["data"]["train"]), eval=str(TINY / raw["data"]["eval"]))
    if cache:
        raw["data"]["cache_dir"] = str(tmp_path / "cache")
    for section in drop:
        raw.pop(section)
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
