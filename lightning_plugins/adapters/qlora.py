"""QLoRA: the frozen base weights of a peft LoRA model stored as 4-bit NF4 (torchao ``NF4Tensor``).

What is converted: the weight of every frozen ``nn.Linear`` of the model, that is the base layer of each
LoRA-wrapped linear *and* the frozen linears LoRA does not target (QLoRA quantizes the whole frozen
base, not only the adapted layers; a linear left dense would hold 4x the bytes for no benefit).
What stays dense: embeddings, norms, biases, the output head (``get_output_embeddings()``; QLoRA via
transformers/bitsandbytes and torchtune keep it dense too), anything trainable, and peft's
``modules_to_save`` copies.

The format: each block of ``block_size`` (64) consecutive row-major elements becomes 4-bit indices
into the NF4 table plus one absmax; the absmaxes are quantized again to int8 in groups of
``scaler_block_size`` blocks ("double quantization"), each group keeping one factor in the weight's
dtype. That is ~4.13 bits per weight: 0.258x the bf16 bytes (0.28x is NF4 without double quantization).
Each converted linear becomes an :class:`~lightning_plugins.adapters.nf4_linear.NF4Linear` (in place), which
dequantizes the weight to the input's dtype on every call, forward and backward, with torchao's values but
in bounded chunks (:mod:`lightning_plugins.adapters.nf4_linear`; torchao's own ``LinearNF4`` holds ~7x the
dense weight in transients); the base never gets a gradient.

How it composes (checked by :func:`lightning_plugins.parallel.quantized.check_quantized` before any collective):

* FSDP2 (``dp_shard``, HSDP, and ``cp``, which FSDP2 shards over too): torchao's ``NF4Tensor`` implements
  FSDP2's all-gather extension, so each rank keeps 1/N of the 4-bit bytes and gathers 4-bit bytes.
  FSDP2 splits dim 0 into equal shards without padding (an NF4 shard cannot be padded): each shard
  needs whole rows and whole scaler groups.
* Pipeline parallelism: each stage keeps its layers' NF4 weights as they are.
* Tensor parallelism: refused. A row-parallel split (``Shard(1)`` of ``o_proj``/``down_proj``) cuts
  through the row-major quantization blocks and scaler groups, and torchao's ``NF4Tensor`` has no
  dim-1 split; a column-parallel ``Shard(0)`` weight is distributed, but its DTensor matmul goes through
  a transposed ``NF4Tensor`` that torchao 0.18 multiplies with the wrong shape.

Order: load the real weights -> ``peft.get_peft_model`` -> :func:`quantize_base_to_nf4` ->
``lightning_plugins.parallelize``; or, what a recipe does, on the meta device: ``apply_lora`` (NF4 weights of the right
sizes, no values) -> ``parallelize`` -> :func:`~lightning_plugins.checkpoint.load.load_sharded_safetensors` (each
rank quantizes only the rows it keeps, bit for bit as one process quantizes the whole weight, with the mean of the
whole weight's block absmaxes; :mod:`lightning_plugins.checkpoint.nf4_rows`: no rank holds the dense base).
Do not ``copy.deepcopy`` a quantized model: torchao's ``clone``
re-quantizes with its default block sizes (lossy, and fails for small weights).
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_plugins.adapters.nf4_linear import NF4Linear
from lightning_plugins.parallel.moe.expert_adapters import is_expert_adapter
from lightning_plugins.parallel.quantized import is_nf4

if TYPE_CHECKING:
    from torchao.quantization import NF4Tensor

__all__ = [
    "default_scaler_block_size",
    "nf4_nbytes",
    "nf4_nbytes_for",
    "quantize_base_to_nf4",
]

#: Elements per quantization block (QLoRA's and torchao's choice).
BLOCK_SIZE = 64
#: The largest scaler group (QLoRA's and torchao's default); smaller layers get smaller groups.
MAX_SCALER_BLOCK_SIZE = 256
#: With ``scaler_block_size=None``, each weight stays shardable over up to this many FSDP2 ranks
#: (where its row count allows): real-size layers keep groups of 256, tiny ones get smaller groups.
SHARDABLE_RANKS = 64

#: Entries of the NF4 lookup table each ``NF4Tensor`` carries.
_NF4_TABLE = 16


@functools.cache
def _torchao() -> tuple[type, Any]:
    """``(NF4Tensor, to_nf4)``, imported on first use: QLoRA is optional.

    ``lightning_plugins/__init__.py`` has already imported torchao with its import-time log noise muted.
    """
    from torchao.quantization import NF4Tensor, to_nf4

    return NF4Tensor, to_nf4


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def nf4_nbytes(tensor: Tensor) -> int:
    """Bytes an ``NF4Tensor`` (or this rank's shard of one) actually holds.

    4-bit codes (``quantized_data``), int8 block absmaxes (``quantized_scalers``), one factor per scaler
    group (``quantization_factor``), the absmax mean (``scaler_mean``) and the 16-entry NF4 table.
    """
    local = _local(tensor)
    if not isinstance(local, _torchao()[0]):
        raise TypeError(f"nf4_nbytes expects an NF4Tensor (or a DTensor of one), got {type(local).__name__}.")
    inner = (local.quantized_data, local.quantized_scalers, local.quantization_factor, local.scaler_mean, local.nf4)
    return sum(t.numel() * t.element_size() for t in inner)


def nf4_nbytes_for(
    numel: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = BLOCK_SIZE,
    scaler_block_size: int = MAX_SCALER_BLOCK_SIZE,
) -> int:
    """Bytes of a whole ``numel``-element weight in NF4 (what :func:`nf4_nbytes` measures), for planning.

    Args:
        numel: Elements of the weight (a multiple of ``block_size * scaler_block_size``).
        dtype: The weight's dtype before quantization (the scaler factors, mean and table keep it).
        block_size: Elements per quantization block.
        scaler_block_size: Blocks per double-quantization group.
    """
    blocks = numel // block_size
    itemsize = torch.empty((), dtype=dtype).element_size()
    return numel // 2 + blocks + (blocks // scaler_block_size) * itemsize + itemsize + _NF4_TABLE * itemsize


def default_scaler_block_size(shape: torch.Size | tuple[int, ...], block_size: int = BLOCK_SIZE) -> int:
    """The largest scaler group (<= 256, a power of two) that leaves a weight shardable by FSDP2.

    FSDP2 needs ``rows`` and the number of scaler groups divisible by the shard count; this keeps them
    divisible by ``gcd(rows, 64)``, so a 4096 x 4096 weight keeps groups of 256 while a 64 x 128 one gets
    groups of 2.
    """
    rows, blocks = shape[0], math.prod(shape) // block_size
    target = math.gcd(rows, SHARDABLE_RANKS)
    size = MAX_SCALER_BLOCK_SIZE
    while size > 1 and (blocks % size or (blocks // size) % target):
        size //= 2
    return size


def quantize_base_to_nf4(
    model: nn.Module, *, block_size: int = BLOCK_SIZE, scaler_block_size: int | None = None, shapes_only: bool = False
) -> int:
    """Store the frozen linear weights of a peft LoRA model as NF4, in place (QLoRA).

    Call it after ``peft.get_peft_model`` (and after the real weights are loaded) and before
    ``lightning_plugins.parallelize``. See the module docstring for what is converted and what stays dense.

    Args:
        model: A ``PeftModel`` (or the transformers model inside it) with LoRA layers.
        block_size: Elements per quantization block (even; must divide each weight's element count).
        scaler_block_size: Blocks per double-quantization group; ``None`` chooses per weight with
            :func:`default_scaler_block_size` so that every weight shards under FSDP2.
        shapes_only: Weights on the meta device become NF4 tensors of the right sizes and no values, for the
            planner's dry run to measure and for the sharded loader to fill (each rank its rows) (their 4-bit codes, scalers and factors on meta; the absmax mean and the 16-entry
            table, a few bytes, on the CPU, so that a step under ``FakeTensorMode`` on the CPU runs through them).
            Such a model can be measured, never trained.

    Returns:
        How many weights were converted (weights that already are NF4 are left as they are).

    Raises:
        ValueError: if the model has no LoRA layer, a LoRA layer wraps something other than ``nn.Linear``
            or ``nn.Embedding``, a weight is on the meta device or already sharded, or a weight does not
            split into the requested blocks.
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    if not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(
            f"block_size must be a positive even integer (NF4 packs two codes per byte), got {block_size!r}."
        )
    if scaler_block_size is not None and (not isinstance(scaler_block_size, int) or scaler_block_size < 1):
        raise ValueError(f"scaler_block_size must be a positive integer or None, got {scaler_block_size!r}.")
    lora_layers = [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    if not lora_layers:
        raise ValueError(
            f"quantize_base_to_nf4: {type(model).__name__} has no LoRA layer. QLoRA quantizes the frozen base under"
            " LoRA adapters: wrap the model first with `peft.get_peft_model(model, LoraConfig(...))`."
        )
    for name, module in lora_layers:
        base = module.get_base_layer()
        if is_expert_adapter(module):
            raise ValueError(
                f"quantize_base_to_nf4: {name} is LoRA on the expert weight {module.parameter_name}; NF4 bases are"
                " nn.Linear weights, and 3-D expert weights are not. QLoRA on a mixture-of-experts model adapts"
                " attention (target_modules) with the experts left in the model's dtype: leave target_parameters out."
            )
        if type(base) not in (nn.Linear, NF4Linear) and not isinstance(base, nn.Embedding):
            raise ValueError(
                f"quantize_base_to_nf4: the LoRA layer {name} wraps a {type(base).__name__}; NF4 bases are supported"
                " for nn.Linear (embeddings stay dense). Leave this module out of `target_modules`."
            )

    # The head and the embedding (the head's weight when tied) stay dense, even when LoRA targets them.
    dense = {id(getattr(_unwrap(embedding, LoraLayer), "weight", None)) for embedding in _embeddings(model)}
    # peft keeps a trainable copy and the original of each `modules_to_save` module: both stay dense.
    wrappers = [module for module in model.modules() if isinstance(module, AuxiliaryTrainingWrapper)]
    skipped = {id(module) for wrapper in wrappers for module in wrapper.modules()}
    to_nf4 = _torchao()[1]
    converted: dict[int, nn.Parameter] = {}  # a weight shared by two linears is converted once
    for name, module in model.named_modules():
        # Exact type: a subclass may compute its output otherwise; NF4Linear computes it with `nf4_linear`.
        if type(module) is not nn.Linear or id(module) in skipped:
            continue
        weight = module.weight
        if weight.requires_grad or id(weight) in dense:
            continue
        # Not yet NF4 (one already NF4 was shared with a linear converted above, or quantized by hand): convert it.
        if not is_nf4(weight):
            if id(weight) not in converted:
                converted[id(weight)] = _to_nf4_parameter(
                    f"{name}.weight", weight, block_size, scaler_block_size, to_nf4, shapes_only
                )
            module.weight = converted[id(weight)]
        module.__class__ = NF4Linear  # in place: peft's LoRA layer, hooks and parameter names stay as they are
    return len(converted)


def _embeddings(model: nn.Module) -> list[nn.Module]:
    """The input and output embedding modules of a transformers model (or a ``PeftModel`` around one)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            continue
        if module is not None:
            found.append(module)
    return found


def _unwrap(module: nn.Module, lora_layer: type) -> nn.Module:
    return module.get_base_layer() if isinstance(module, lora_layer) else module


def _to_nf4_parameter(
    name: str, weight: Tensor, block_size: int, scaler_block_size: int | None, to_nf4: Any, shapes_only: bool
) -> nn.Parameter:
    shape = tuple(weight.shape)
    if isinstance(weight, DTensor):
        raise ValueError(
            f"quantize_base_to_nf4: {name} is already distributed ({weight.placements}). Quantize before"
            " `lightning_plugins.parallelize`, which then shards the NF4 weights."
        )
    if weight.is_meta != shapes_only:
        if shapes_only:
            raise ValueError(f"quantize_base_to_nf4(shapes_only=True): {name} is not on the meta device.")
        raise ValueError(
            f"quantize_base_to_nf4: {name} is on the meta device. NF4 codes are computed from the values: load the"
            " real weights first (e.g. `from_pretrained`), then quantize."
        )
    if weight.numel() % block_size:
        raise ValueError(
            f"quantize_base_to_nf4: {name} of shape {shape} has {weight.numel()} elements, not a multiple of"
            f" block_size={block_size}. Use a block_size that divides it, or leave this module out of the model's"
            " frozen linears."
        )
    blocks = weight.numel() // block_size
    group = default_scaler_block_size(shape, block_size) if scaler_block_size is None else scaler_block_size
    if blocks % group:
        raise ValueError(
            f"quantize_base_to_nf4: {name} of shape {shape} has {blocks} blocks of {block_size}, not a multiple of"
            f" scaler_block_size={group}. Pass scaler_block_size=None to choose a group size per weight"
            f" (here {default_scaler_block_size(shape, block_size)})."
        )
    nf4 = _nf4_of_shape(weight, block_size, group) if shapes_only else to_nf4(weight.detach().contiguous(), block_size, group)
    return nn.Parameter(nf4, requires_grad=False)


def _nf4_of_shape(weight: Tensor, block_size: int, scaler_block_size: int) -> NF4Tensor:
    """An ``NF4Tensor`` of ``weight``'s shape holding what ``to_nf4`` would, without values (``shapes_only``).

    Its codes, scalers and factors are on the meta device; the absmax mean and the table on the CPU, where the
    dry run's fake step reads them with the codes. (``to_nf4`` on a meta weight computes nothing but still walks
    its blocks in chunks: minutes for a 70B model.)
    """
    nf4_tensor = _torchao()[0]
    args = importlib.import_module(nf4_tensor.__module__).SubclassTensorArgs
    blocks = weight.numel() // block_size
    meta = {"device": "meta"}
    return nf4_tensor(
        args(weight.size(), weight.stride(), 0, weight.dtype, torch.device("meta"), False),
        block_size,
        blocks,
        scaler_block_size,
        torch.empty(blocks, dtype=torch.int8, **meta),  # quantized_scalers
        torch.empty(blocks // scaler_block_size, dtype=weight.dtype, **meta),  # quantization_factor
        torch.zeros((), dtype=weight.dtype),  # scaler_mean
        torch.empty(weight.numel() // 2, dtype=torch.uint8, **meta),  # quantized_data
        torch.zeros(_NF4_TABLE, dtype=weight.dtype),  # nf4
    )
