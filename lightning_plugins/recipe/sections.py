"""The recipe's small sections: the model to fine-tune, the optimizer, the hardware it runs on (the ``train``
section, by concern, is :mod:`lightning_plugins.recipe.train`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """A recipe section: unknown keys are refused, and a resolved section is not changed in place."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(Section):
    """What to fine-tune."""

    path: str
    """A local HF checkpoint directory (relative to the recipe file) or a hub id."""
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter dtype (``fp32`` on CPU; ``bf16`` on GPUs, with ``memory.param_dtype`` for FSDP2)."""
    attn_implementation: str = "sdpa"
    """transformers' attention (``sdpa``, ``eager``, ``flash_attention_2``, ...)."""
    trust_remote_code: bool = False
    """Run the Python code a hub model ships for its config, tokenizer and model. Off by default: only turn it on for a
    model whose code you have read."""



class OptimSection(Section):
    """AdamW (``name``: torch's ``adamw``, or torchao's ``adamw8bit``: 8-bit moments) with linear warmup and a decay."""

    lr: float = Field(2e-5, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """``cosine``, ``linear`` (decay to ``min_lr_ratio * lr`` at the last step) or ``constant``."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup from 0 to ``lr``."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """The final learning rate as a fraction of ``lr``."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; ``null`` for no clipping."""
    name: Literal["adamw", "adamw8bit"] = "adamw"
    """``adamw`` (torch's) or ``adamw8bit`` (torchao's 8-bit AdamW: 2 bytes of state per parameter, not 8)."""


class HardwareSection(Section):
    """Where it runs. ``devices`` x ``nodes`` processes make the world the layout must fill."""

    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    """``cpu``, ``gpu`` or ``auto``."""
    devices: int = Field(1, ge=1)
    """Processes (GPUs) per node."""
    nodes: int = Field(1, ge=1)
    """Nodes (machines), each running ``devices`` processes."""
    gpu: str | None = None
    """The GPU model ``lightning-plugins plan`` checks against: memory, FLOP/s, links (``H100``, ``A100``, ...)."""
    gpu_memory_gb: float | None = Field(None, gt=0)
    """Memory of one GPU, in GiB, when it differs from the GPU model's."""
    host_memory_gb: float | None = Field(None, gt=0)
    """Host RAM of one node (loading and training checked against it), in GiB, when it differs from the GPU model's
    usual node's (8 x H100: 2 TiB)."""

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    def device_type(self) -> str:
        """The device type a run of this recipe trains on here: ``cuda`` unless ``accelerator: cpu`` or torch sees no
        GPU (``auto`` then runs on CPU processes; ``gpu`` is refused by the preflight)."""
        import torch

        return "cuda" if self.accelerator != "cpu" and torch.cuda.is_available() else "cpu"
