"""The dry run of an image-text recipe: the whole model (vision tower, projector, language model), a step with images.

A recipe whose data holds images trains ``AutoModelForImageTextToText`` (:mod:`lightning_plugins.recipe.image_text`),
so its dry run builds that model from the checkpoint's whole config on the meta device, freezes or trains the tower
and the projector as the ``vision:`` section says (or applies LoRA), and lets :func:`lightning_plugins.parallelize`
lay it out as the engine does for image-text models (each vision block and the projector their own FSDP2 units; under
TP the tower replicated). The counted state is the engine's sharded tensors: the tower's and the projector's
parameters, and their gradients and AdamW moments where they train.

The measured step holds images (:class:`ImageInputs`): ``vision.images_per_sample`` square images of
``vision.image_size`` pixels per sample (the defaults: one image of 1024 px), each processed by the model's own image
processor (its ``preprocessor_config.json``, shipped beside the config) for the shape of ``pixel_values`` and the
model's per-image inputs (Qwen's ``image_grid_thw``); the image tokens those images become are placed in every row
(between the model's vision start and end tokens), the rest of the row is text. What the data of a run really holds
(its images' count and size) is the recipe's assumption to adjust, and the report says what it assumed.

An image-text model reads the values of its small per-token and per-image inputs (Qwen's 3-D RoPE positions from the
image grid, the vision tower's windows, the check that image tokens and features agree), which fake tensors do not
have: :class:`RealMetadata` runs every operation whose inputs are all real tensors (those inputs, and the integer
tensors the model builds from them) for real, while the weights, the activations and ``pixel_values`` stay fake.

The step time counts the image path's FLOPs (:meth:`ImageInputs.compute`): one image's forward through the model's own
``get_image_features`` (its tower and projector) is counted once by torch's ``FlopCounterMode`` on a fake copy of the
model (:func:`image_flops`: matmuls, convolutions and attention, the CPU attention kernel's included), split into the
vision blocks, the rest of the tower (patch embedding) and the projector;
:class:`~lightning_plugins.planner.rank_time.VisionCompute` turns them into training FLOPs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_plugins.adapters.vision import VisionOptions, freeze_vision
from lightning_plugins.errors import PlannerError
from lightning_plugins.parallel.dtypes import DTYPES
from lightning_plugins.planner.rank_time import VisionCompute

if TYPE_CHECKING:
    from lightning_plugins.planner.workload import Workload

__all__ = ["ImageInputs", "RealMetadata", "image_batch", "image_flops", "image_text_model", "real_metadata"]

#: What :func:`image_flops` counted, by the whole config, one image's ``pixel_values`` shape and per-image inputs.
_COUNTED: dict[tuple[str, tuple[int, ...], str], tuple[float, float, float, int]] = {}
#: Dtypes of the tensors the model builds from its real inputs and reads (positions, indices, masks).
_EXACT = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
#: A tensor made from nothing (``arange``, ``zeros``) is made real when it is an integer tensor at most this large.
_LARGEST_REAL_FACTORY = 2**24
#: Config keys of the tokens that mark images (their ids are kept out of the rows' random text).
_MARKER_KEYS = ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                "vision_token_id", "boi_token_index", "eoi_token_index")  # fmt: skip


@dataclass(frozen=True)
class ImageInputs:
    """The images of an image-text workload's measured step, and the whole model's config.

    Attributes:
        config: The checkpoint's whole image-text config (the workload's ``config`` is its text decoder's).
        vision: The recipe's ``vision:`` section (what trains, and the images assumed per sample).
        pixels: The shape of one image's ``pixel_values``, as the model's image processor gives it.
        per_image: The processor's other per-image inputs of one image (e.g. ``image_grid_thw``: ``[[1, 74, 74]]``).
        tokens_per_image: The image tokens one image becomes in the sequence.
    """

    config: Any
    vision: VisionOptions
    pixels: tuple[int, ...]
    per_image: dict[str, list] = field(default_factory=dict)
    tokens_per_image: int = 0

    @classmethod
    def of(cls, spec: str | Path, vision: VisionOptions) -> ImageInputs:
        """The images of ``spec``'s model (a directory, a shipped config's name or hub id) under ``vision``."""
        from lightning_plugins.planner.model_stats import load_model_config, model_config_dir

        config = load_model_config(spec, multimodal=True)
        if getattr(config, "vision_config", None) is None:
            raise PlannerError(
                f"{spec}: the data holds images but the model's config ({config.model_type}) has no vision tower."
                " Point model.path at an image-text model (AutoModelForImageTextToText)."
            )
        processed = _processed(model_config_dir(spec) or str(spec), vision.image_size)
        pixels = tuple(processed.pop("pixel_values").shape)
        per_image = {key: value.tolist() for key, value in processed.items() if key == "image_grid_thw"}
        return cls(config, vision, pixels, per_image, _tokens_per_image(config, per_image, pixels))

    @property
    def per_sample(self) -> int:
        return self.vision.images_per_sample

    def tokens_per_sample(self) -> int:
        """Tokens a sample's images take in its row, their start and end markers included."""
        return self.per_sample * (self.tokens_per_image + len(_markers(self.config)))

    def trains(self, lora: bool) -> tuple[bool, bool]:
        """``(tower, projector)``: whether each part's own weights train."""
        return self.vision.trains(lora=lora)

    def compute(self, lora: bool) -> VisionCompute:
        """The image path's work per image for the step-time model: its forward FLOPs and what trains."""
        tower, projector = self.trains(lora)
        return VisionCompute(*self._forward_flops, self.per_sample, tower, projector)

    @functools.cached_property
    def _forward_flops(self) -> tuple[float, float, float, int]:
        key = (self.config.to_json_string(), self.pixels, repr(self.per_image))
        if key not in _COUNTED:  # a search plans many layouts of one model and image size: counted once per process
            _COUNTED[key] = image_flops(self.config, self.pixels, self.per_image)
        return _COUNTED[key]

    def describe(self, seq_len: int, lora: bool) -> str:
        """What the dry run assumed about the images, for the report."""
        tower, projector = self.trains(lora)
        side = self.vision.image_size
        return (
            f"images: {self.per_sample} per sample of {side}x{side} px (vision.images_per_sample,"
            f" vision.image_size; the data decides in a run), {self.tokens_per_image} image tokens each:"
            f" {self.tokens_per_sample()} of each row's {seq_len} tokens; pixel_values {list(self.pixels)} per image;"
            f" vision tower {'trained' if tower else 'frozen'}, projector {'trained' if projector else 'frozen'}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "images_per_sample": self.per_sample,
            "image_size": self.vision.image_size,
            "tokens_per_image": self.tokens_per_image,
            "pixel_values_per_image": list(self.pixels),
            **self.per_image,
        }


def _processed(source: str | Path, side: int) -> dict[str, torch.Tensor]:
    """The model's image processor's output for one blank ``side`` x ``side`` image."""
    from PIL import Image
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError) as err:
        raise PlannerError(
            f"{source}: the model's image processor could not be loaded offline ({err}); the planner needs its"
            " preprocessor_config.json beside config.json for the images' shapes. Point model.path at a directory that"
            " holds both."
        ) from None
    return dict(processor(images=[Image.new("RGB", (side, side))], return_tensors="pt"))


def _tokens_per_image(config: Any, per_image: dict[str, list], pixels: tuple[int, ...]) -> int:
    """Image tokens of one image: a grid of patches merged ``spatial_merge_size`` squared into one (Qwen), or the
    config's fixed count (Gemma 3's ``mm_tokens_per_image``)."""
    grid = per_image.get("image_grid_thw")
    if grid is not None:
        merge = getattr(config.vision_config, "spatial_merge_size", 1)
        t, h, w = grid[0]
        return t * h * w // merge**2
    fixed = getattr(config, "mm_tokens_per_image", None)
    if fixed:
        return fixed * pixels[0]  # one fixed-size image each crop (Gemma 3's pan and scan is off by default)
    raise PlannerError(
        f"{config.model_type}: the planner cannot tell how many tokens an image becomes (no image_grid_thw from its"
        " processor, no mm_tokens_per_image in its config). Plan its text decoder alone, or file an issue naming it."
    )


def _markers(config: Any) -> tuple[int, ...]:
    """The tokens around an image's tokens: the vision start and end (Qwen), begin and end of image (Gemma 3)."""
    start = getattr(config, "vision_start_token_id", None) or getattr(config, "boi_token_index", None)
    end = getattr(config, "vision_end_token_id", None) or getattr(config, "eoi_token_index", None)
    return tuple(token for token in (start, end) if token is not None)


def _image_token(config: Any) -> int:
    return getattr(config, "image_token_id", None) or config.image_token_index


def image_flops(config: Any, pixels: tuple[int, ...], per_image: dict[str, list]) -> tuple[float, float, float, int]:
    """One image's forward FLOPs through the image path: ``(vision blocks, the rest of the tower, projector, number of
    vision blocks)``.

    Counted by ``FlopCounterMode`` on the model's own ``get_image_features`` of one image (``pixels``: its
    ``pixel_values`` shape; ``per_image``: e.g. its ``image_grid_thw``), the model built on the meta device with a
    one-layer language model and run under ``FakeTensorMode`` (:class:`RealMetadata`: the image grid stays real). The
    CPU attention kernel is counted as torch counts the GPU ones. Each vision block's and projector module's share is
    what the counter counted during its forward.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForImageTextToText

    from lightning_plugins.parallel.image_text import image_text_parts

    config = copy.deepcopy(config)
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers = 1  # the language model does not run: one layer is built, quickly
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:1]
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    parts = image_text_parts(model)
    base = model.get_submodule(parts.language_path.rpartition(".")[0])
    counter = FlopCounterMode(display=False, custom_mapping={_CPU_ATTENTION: _attention_flops})
    shares = {"blocks": 0, "projector": 0}
    handles = []
    blocks = list(model.get_submodule(parts.blocks_path))
    for share, modules in (("blocks", blocks), ("projector", [model.get_submodule(p) for p in parts.projector_paths])):
        for module in modules:
            handles += _counting_hooks(module, counter, shares, share)
    accepted = inspect.signature(base.get_image_features).parameters
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            pixel_values = torch.empty(pixels)
            with unset_fake_temporarily():
                given = {key: torch.tensor(value) for key, value in per_image.items() if key in accepted}
            with counter, RealMetadata():
                base.get_image_features(pixel_values=pixel_values, **given)
    finally:
        for handle in handles:
            handle.remove()
    total = float(counter.get_total_flops())
    rest = total - shares["blocks"] - shares["projector"]
    return float(shares["blocks"]), rest, float(shares["projector"]), len(blocks)


def _counting_hooks(module: nn.Module, counter: Any, shares: dict[str, int], share: str) -> list[Any]:
    """Hooks that add to ``shares[share]`` what ``counter`` counts during ``module``'s forward."""
    start: list[int] = []

    def before(*_: Any) -> None:
        start.append(counter.get_total_flops())

    def after(*_: Any) -> None:
        shares[share] += counter.get_total_flops() - start.pop()

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


#: The CPU kernel of scaled dot-product attention, which torch's flop counter leaves out (it counts the GPU kernels).
_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attention_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def image_text_model(workload: Workload) -> nn.Module:
    """The whole image-text model of ``workload`` on the meta device (its text decoder's config is the workload's,
    so a measured copy with fewer decoder layers keeps the whole tower), the tower and the projector frozen or
    trained as ``vision:`` says for a full fine-tune (with LoRA, applied next, only the adapters train)."""
    from transformers import AutoModelForImageTextToText

    images = workload.images
    config = copy.deepcopy(images.config)
    config.text_config = copy.deepcopy(workload.config)
    config.text_config.use_cache = False  # training: the language model's own setting, or its layers warn under AC
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            config, dtype=DTYPES[workload.dtype], attn_implementation=workload.attn_implementation
        )
    model.config.use_cache = False
    model.train()
    if workload.lora is None:
        freeze_vision(model, images.vision)
    return model


def image_batch(workload: Workload, mesh: Any) -> dict[str, torch.Tensor]:
    """One micro-batch of ``workload``'s rows with their images, laid out for ``mesh`` (under context parallelism the
    model shards it once the images are placed).

    Runs under ``FakeTensorMode``: ``pixel_values`` is fake, the token-level inputs and the image grid are real.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from lightning_plugins.parallel import context_parallel_batch

    images, rows, seq = workload.images, workload.micro_batch_size, workload.seq_len
    count = rows * images.per_sample
    pixel_values = torch.empty((count * images.pixels[0], *images.pixels[1:]), dtype=torch.float32)
    with unset_fake_temporarily():
        ids, labels = _row(images, seq, workload.config.vocab_size)
        batch = {"input_ids": ids.repeat(rows, 1), "labels": labels.repeat(rows, 1)}
        types = _type_ids_key(images.config)
        if types is not None:
            batch[types] = (batch["input_ids"] == _image_token(images.config)).long()
        batch.update({key: torch.tensor(value).repeat(count, 1) for key, value in images.per_image.items()})
    batch["pixel_values"] = pixel_values
    if workload.layout.cp_size == 1:
        return batch
    with RealMetadata():
        return context_parallel_batch(batch, mesh)


def _row(images: ImageInputs, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: its images first (each between its markers), then random text; only the text is trained."""
    config = images.config
    placed = images.tokens_per_sample()
    if placed >= seq:
        raise PlannerError(
            f"{images.per_sample} image(s) per sample of {images.vision.image_size} px take {placed} tokens, not fewer"
            f" than the rows' {seq} (data.max_seq_len): lower vision.images_per_sample or vision.image_size, or"
            " raise data.max_seq_len."
        )
    markers = [getattr(config, key) for key in _MARKER_KEYS if isinstance(getattr(config, key, None), int)]
    text_ids = min([vocab, *(token for token in markers if token > 0)])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, text_ids, (seq,), generator=generator)
    start, end = _markers(config)[:1], _markers(config)[1:]
    image = torch.tensor([*start, *[_image_token(config)] * images.tokens_per_image, *end])
    ids[:placed] = image.repeat(images.per_sample)
    labels = ids.clone()
    labels[:placed] = -100
    return ids, labels


def _type_ids_key(config: Any) -> str | None:
    """The input that marks image tokens in the model's forward: Qwen's ``mm_token_type_ids`` (its 3-D positions),
    Gemma 3's ``token_type_ids`` (its images attend both ways); ``None`` when it takes neither."""
    from transformers import AutoModelForImageTextToText

    model_class = AutoModelForImageTextToText._model_mapping[type(config)]
    parameters = inspect.signature(model_class.forward).parameters
    return next((key for key in ("mm_token_type_ids", "token_type_ids") if key in parameters), None)


class RealMetadata(TorchDispatchMode):
    """Under ``FakeTensorMode``: an operation whose tensor inputs are all real plain tensors runs for real, as does
    one that makes a small integer tensor from nothing; every other operation goes on to the fake mode.

    The model's token-level inputs and image grid stay real through the values it reads from them (positions, window
    indices, the image-token count it checks), while whatever touches a fake weight or activation is fake.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if not tensors:
            made = func(*args, **kwargs)
            small = isinstance(made, torch.Tensor) and made.dtype in _EXACT and made.numel() <= _LARGEST_REAL_FACTORY
            if not small:
                return made
        elif not all(type(tensor) is torch.Tensor and not tensor.is_meta for tensor in tensors):
            if func in _INDEXING:  # a fake tensor indexed by a real mask (Qwen3-VL's deepstack features)
                args = (args[0], _mask_positions(args[1]), *args[2:])
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


#: Indexing operations whose boolean index the fake mode would have to count (``nonzero``), which it cannot.
_INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)


def _mask_positions(indices: list) -> list:
    """Indices with every real boolean mask replaced by the positions it selects (one index tensor per dimension it
    covers), computed for real: the same selection, of a size the fake mode knows."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    positions: list = []
    for index in indices:
        if type(index) is torch.Tensor and index.dtype == torch.bool:
            with unset_fake_temporarily():
                positions.extend(index.nonzero().unbind(1))
        else:
            positions.append(index)
    return positions


@contextlib.contextmanager
def real_metadata(batch: dict[str, Any]) -> Iterator[None]:
    """:class:`RealMetadata` around a step whose batch holds images or packed preference pairs (whose objective
    reads each row's pair count and sums by the real sequence numbers); nothing for another text batch."""
    from lightning_plugins.parallel.context.batch import SEQUENCE_IDS

    if "pixel_values" not in batch and SEQUENCE_IDS not in batch:
        yield
        return
    with RealMetadata():
        yield
