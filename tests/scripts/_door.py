"""What the door-driving test scripts share: the chosen door's runner module (to patch hooks into) and its main."""

from __future__ import annotations

from types import ModuleType


def runner_of(door: str) -> ModuleType:
    """The module whose ``build_model`` (and friends) the ``door`` calls: ``finetune`` or ``accelerate``."""
    if door == "finetune":
        import lightning_plugins.strategies.runner as runner
    else:
        import lightning_plugins.accelerate.runner as runner  # type: ignore[no-redef]
    return runner


def run_door(door: str, argv: list[str]) -> None:
    """Run ``door``'s command line as a user would (``lightning-plugins finetune ...`` or the Accelerate runner)."""
    if door == "finetune":
        from lightning_plugins.cli import main as cli

        cli(["finetune", *argv])
    else:
        from lightning_plugins.accelerate.__main__ import main as accelerate_main

        accelerate_main(argv)
