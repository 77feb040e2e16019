"""What of an image-text model trains: the vision tower and the projector, each frozen or trained
(:class:`VisionOptions`, the recipe's ``vision:`` section), applied by :func:`freeze_vision` before the model is
parallelized.

The defaults are the common recipes' (LLaVA's second stage, Qwen2.5-VL's and Gemma 3's fine-tuning examples): the
projector and the language model train, the vision tower stays frozen. The parts are found by structure
(:func:`~lightning_plugins.parallel.image_text.image_text_parts`), not by family. With LoRA only the adapters train (on
the language model's projections by default, :mod:`lightning_plugins.adapters.lora`): a fully trained tower or
projector beside adapters is refused, since the adapter directory would not hold its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_plugins.errors import OptionsError
from lightning_plugins.parallel.image_text import image_text_parts

__all__ = ["VisionOptions", "freeze_vision"]


@dataclass(frozen=True)
class VisionOptions:
    """The recipe's ``vision:`` section: which parts of an image-text model train beside its language model, and
    the images the planner assumes a sample holds."""

    train_tower: bool | None = None
    """Train the vision tower (encoder). ``None``: frozen (a full fine-tune), the adapters only (LoRA)."""
    train_projector: bool | None = None
    """Train the projector (merger) that maps the tower's features into the language model. ``None``: trained (a
    full fine-tune), the adapters only (LoRA)."""
    images_per_sample: int = 1
    """For the planner only (``lightning-plugins plan``): the images each sample of the measured step holds. A run
    takes its images from the data."""
    image_size: int = 1024
    """For the planner only: the side, in pixels, of the square images the measured step holds before the model's
    image processor resizes them (Qwen2.5-VL: 1024 px is 74 x 74 patches, 1369 image tokens; Gemma 3 resizes every
    image to 896 px, 256 tokens)."""

    def __post_init__(self) -> None:
        if self.images_per_sample < 1 or self.image_size < 1:
            raise OptionsError(
                f"vision.images_per_sample={self.images_per_sample}, vision.image_size={self.image_size}: the planner"
                " measures a step with at least one image of at least one pixel. Give positive values."
            )

    def trains(self, lora: bool) -> tuple[bool, bool]:
        """``(tower, projector)``: whether each part's own weights train, the defaults resolved.

        Raises:
            OptionsError: a part set to train under LoRA.
        """
        if lora and (self.train_tower or self.train_projector):
            part = "vision.train_tower" if self.train_tower else "vision.train_projector"
            raise OptionsError(
                f"{part}: true trains that part's own weights, but with a lora section only the adapters train (and"
                " only they are saved). Remove the key, or reach the part's linear layers with lora.target_modules,"
                " or drop the lora section for a full fine-tune."
            )
        if lora:
            return False, False
        return bool(self.train_tower), self.train_projector is not False


def freeze_vision(model: nn.Module, options: VisionOptions) -> dict[str, int]:
    """Sets ``requires_grad`` of the vision tower's and the projector's parameters as ``options`` say (a full
    fine-tune; call it before LoRA or parallelizing); returns the parameters each part holds that train.

    Raises:
        OptionsError: for a model without a vision tower while a part is asked to train.
    """
    parts = image_text_parts(model)
    if parts is None:
        if options.train_tower or options.train_projector:
            raise OptionsError(
                f"vision: {type(model).__name__} has no vision tower (its config has no vision_config), so"
                " vision.train_tower / vision.train_projector have nothing to train. Remove the vision section."
            )
        return {}
    tower, projector = options.trains(lora=False)
    trained = {"vision_tower": 0, "projector": 0}
    projector_params = {id(p) for path in parts.projector_paths for p in model.get_submodule(path).parameters()}
    for parameter in model.get_submodule(parts.vision_path).parameters():
        if id(parameter) not in projector_params:  # Qwen's merger sits inside the tower
            parameter.requires_grad_(tower)
            trained["vision_tower"] += parameter.numel() * tower
    for path in parts.projector_paths:
        for parameter in model.get_submodule(path).parameters():
            parameter.requires_grad_(projector)
            trained["projector"] += parameter.numel() * projector
    return trained
