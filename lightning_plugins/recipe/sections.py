"""The recipe's small sections: the model to fine-tune, the optimizer, the hardware it runs on (the ``train``
section, by concern, is :mod:`lightning_plugins.recipe.train`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """A recipe section: unknown keys are refused, and a resolved section is not changed in place."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(Section):
    """What to fine-tune.

    Attributes:
        path: A local HF checkpoint directory (relative to the recipe file) or a hub id.
        dtype: Parameter dtype (``fp32`` on CPU; ``bf16`` on GPUs, with ``memory.param_dtype`` for FSDP2).
        attn_implementation: transformers' attention (``sdpa``, ``eager``, ``flash_attention_2``, ...).
        trust_remote_code: Run the Python code a hub model ships for its config, tokenizer and model. Off by
            default: only turn it on for a model whose code you have read.
    """

    path: str
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False



class OptimSection(Section):
    """AdamW (``name``: torch's ``adamw``, or torchao's ``adamw8bit``: 8-bit moments) with linear warmup and a decay.

    Attributes:
        lr: Peak learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
        scheduler: ``cosine``, ``linear`` (decay to ``min_lr_ratio * lr`` at the last step) or ``constant``.
        warmup_steps: Linear warmup from 0 to ``lr``.
        min_lr_ratio: The final learning rate as a fraction of ``lr``.
        max_grad_norm: Clip the global gradient norm to this; ``null`` for no clipping.
        name: ``adamw`` (torch's) or ``adamw8bit`` (torchao's 8-bit AdamW: 2 bytes of state per parameter, not 8).
    """

    lr: float = Field(2e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    name: Literal["adamw", "adamw8bit"] = "adamw"


class HardwareSection(Section):
    """Where it runs. ``devices`` x ``nodes`` processes make the world the layout must fill.

    Attributes:
        accelerator: ``cpu``, ``gpu`` or ``auto``.
        devices, nodes: Processes (GPUs) per node, and nodes.
        gpu: The GPU model ``lightning-plugins plan`` checks against: memory, FLOP/s, links (``H100``, ``A100``, ...).
        gpu_memory_gb, host_memory_gb: Memory of one GPU, and host RAM of one node (loading and training checked
            against it), in GiB, when they differ from the GPU model's and its usual node's (8 x H100: 2 TiB).
    """

    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    devices: int = Field(1, ge=1)
    nodes: int = Field(1, ge=1)
    gpu: str | None = None
    gpu_memory_gb: float | None = Field(None, gt=0)
    host_memory_gb: float | None = Field(None, gt=0)

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes
