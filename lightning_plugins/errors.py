"""Every error this package raises on purpose, under one base class.

Catch :class:`LightningPluginsError` to catch them all. Each subclass says what kind of input was wrong, and its
message names the file, key or constraint and a fix. Most also derive from the built-in exception a caller would
expect (``ValueError`` for bad input, ``OSError`` for a failed write, ``RuntimeError`` for a failed run), so code
written against those keeps working.
"""

from __future__ import annotations


class LightningPluginsError(Exception):
    """Base class of the errors raised by lightning_plugins."""


class LayoutError(LightningPluginsError, ValueError):
    """A layout (the parallel sizes) that cannot work for this world size or model; the message names the fix."""


class OptionsError(LightningPluginsError, ValueError):
    """A setting other than the layout (parallel, memory, LoRA or QLoRA options) that cannot work for this model or
    layout; the message names the setting and the fix."""


class RecipeError(LightningPluginsError, ValueError):
    """A recipe that cannot run; the message names the file, the key and a fix."""


class ResumeMismatch(RecipeError):
    """A resume refused: the recipe differs from the checkpoint's where continuing would be silently wrong."""


class DataError(LightningPluginsError, ValueError):
    """A dataset input that cannot be used; the message names the file, line or key, and a fix."""


class CheckpointError(LightningPluginsError, ValueError):
    """A checkpoint that cannot be resumed from; the message names the path and a fix."""


class CheckpointWriteError(LightningPluginsError, OSError):
    """A checkpoint could not be written where it was asked to be; the message names the path, needed and free bytes."""


class ExportError(LightningPluginsError, ValueError):
    """A checkpoint that cannot be exported as asked; the message names the file or key and the fix."""


class PlannerError(LightningPluginsError, ValueError):
    """A planner input that cannot work; the message names it and the fix."""


class RunLockError(LightningPluginsError, RuntimeError):
    """The output directory is held by another run that is still alive."""


class RankFailure(LightningPluginsError, RuntimeError):
    """A rank of the job failed; the message names it (rank, pid) and the cause."""


class NonFiniteError(LightningPluginsError, RuntimeError):
    """Training met a non-finite loss, gradient norm or weight; the message names the step, the ranks and the fix."""


def summarize(error: BaseException, limit: int = 400) -> str:
    """``Type: first line of the message`` (shortened to ``limit`` characters)."""
    text = str(error).strip().splitlines()
    line = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."
