"""How often the engine checks a layout's settings in a run: :func:`counted_settings_checks` counts the calls of
:func:`~lightning_plugins.parallel.checks.check_settings` (every check) and of
:func:`~lightning_plugins.parallel.checks.check_model_fit` (what the model's config adds, for a plan checked before
its model existed), whichever module of the package makes them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHECKS = ("check_settings", "check_model_fit")


@contextmanager
def counted_settings_checks() -> Iterator[list[tuple[str, Any]]]:
    """Within the block, every call of a check made from outside the checks appends ``(its name, the config it checked
    against)`` (``None``: none); ``check_settings``'s own call of ``check_model_fit`` is part of it, not counted."""
    from lightning_plugins.parallel import checks

    originals = {name: getattr(checks, name) for name in CHECKS}
    calls: list[tuple[str, Any]] = []
    depth = [0]

    def counted(name: str) -> Any:
        def check(*args: Any, **kwargs: Any) -> Any:
            config = args[-1] if len(args) > (3 if name == "check_settings" else 2) else kwargs.get("config")
            if depth[0] == 0:
                calls.append((name, config))
            depth[0] += 1
            try:
                return originals[name](*args, **kwargs)
            finally:
                depth[0] -= 1

        return check

    replaced = {name: counted(name) for name in CHECKS}
    holders = [
        (module, name)
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("lightning_plugins")
        for name in CHECKS
        if getattr(module, name, None) is originals[name]
    ]
    for module, name in holders:
        setattr(module, name, replaced[name])
    try:
        yield calls
    finally:
        for module, name in holders:
            setattr(module, name, originals[name])
