"""How often the engine checks a layout's settings in a run: :func:`counted_settings_checks` counts the calls of
:func:`~lightning_plugins.parallel.checks.check_settings`, whichever module of the package makes them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def counted_settings_checks() -> Iterator[list[Any]]:
    """Within the block, every ``check_settings`` call appends the config it checked against (``None``: none)."""
    from lightning_plugins.parallel import checks

    original, calls = checks.check_settings, []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[3] if len(args) > 3 else kwargs.get("config"))
        return original(*args, **kwargs)

    holders = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("lightning_plugins") and getattr(module, "check_settings", None) is original
    ]
    for module in holders:
        module.check_settings = counted
    try:
        yield calls
    finally:
        for module in holders:
            module.check_settings = original
