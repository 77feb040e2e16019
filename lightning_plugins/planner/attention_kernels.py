"""Which kernel each layer's attention runs on, per context-parallel backend, and the seconds it costs.

The engine computes attention by different kernels depending on the layout (``lightning_plugins/parallel/context``):

* **flash**: the model's own fused kernel (no context parallelism; Ulysses for a layer without a window, soft-capping
  or sinks) and ring attention's blocks, which run on the flash kernel piece by piece (its causal and full calls, a
  window's band as squares and boxes, sinks joined in the log-sum-exp merge). A sliding-window layer costs its band
  (``min(window, seq)`` keys per query, :meth:`~.model_stats.ModelStats.attention_flops_per_token`).
* **ring tiles**: ring attention with soft-capping (Gemma 2): no fused kernel computes ``softcap * tanh`` with its
  backward, so every block is pure-torch tiles, matmuls in fp32 (the accumulation dtype); the band still only.
* **eager**: Ulysses for a layer with a window, soft-capping or sinks calls eager attention on the gathered sequence
  (``parallel/context/wiring._inner_attention``): the whole ``seq x seq`` square of scores is materialised, a window
  saves nothing.

Linear-attention layers (Gated DeltaNet) keep their own kernels, counted as a window of their chunk.

Each is charged at the calibrated attention efficiency times its own factor (:data:`KERNEL_SPEED`).
"""

from __future__ import annotations

from lightning_plugins.planner.model_stats import LINEAR_ATTENTION_CHUNK, ModelStats

#: The flash kernel: the calibrated attention efficiency (``planner.timing.KERNELS``).
FLASH = "flash"
#: Ring attention's pure-torch tiles (soft-capping).
RING_TILES = "ring tiles"
#: Eager attention, the whole square of scores materialised (Ulysses with a window, soft-capping or sinks).
EAGER = "eager"

#: Speed of each kernel against the flash kernel's calibrated efficiency (assumptions, not measured on a GPU here).
#: Ring tiles: their matmuls run in fp32 (torch leaves TF32 off for matmuls by default) at the fp32 rate, 67 of the
#: H100 SXM's 989 dense bf16 TFLOP/s (datasheet), their elementwise work not counted. Eager: the scores go through
#: HBM several times (matmul out, scale and mask, softmax in fp32 and back, ~12 bytes per score) against 4 x head_dim
#: FLOPs of the two matmuls: at head_dim 128 on an H100 (3.35 TB/s, 989 TFLOP/s) memory-bound at about 1/7 of the
#: flash rate.
KERNEL_SPEED = {FLASH: 1.0, RING_TILES: 67.0 / 989.0, EAGER: 1.0 / 7.0}


def layer_kernels(stats: ModelStats, cp_backend: str, cp_size: int) -> tuple[tuple[str, int], ...]:
    """Per decoder layer, (its attention kernel, the keys a query computes against) at one token of ``seq`` keys:
    the window (``0``: the whole row)."""
    windows = stats.attention_windows or (0,) * stats.num_layers
    variants = set(stats.attention_variants) - {"linear"}
    out = []
    for window in windows:
        # A linear-attention layer (counted as a window of its chunk) runs its own kernels under every layout.
        linear = "linear" in stats.attention_variants and window == LINEAR_ATTENTION_CHUNK
        if cp_size <= 1 or linear:
            out.append((FLASH, window))
        elif cp_backend == "ring":
            out.append((RING_TILES if "softcap" in variants else FLASH, window))
        elif window or variants:
            out.append((EAGER, 0))  # the whole square: eager attention masks the window, it does not skip it
        else:
            out.append((FLASH, 0))
    return tuple(out)


def attention_seconds_per_token(
    stats: ModelStats, seq_len: int, cp_backend: str, cp_size: int, flash_rate: float
) -> float:
    """Seconds of one token's attention forward, summed over all layers, at the flash kernel's ``flash_rate``
    (FLOP/s); each layer on its kernel (:func:`layer_kernels`), ``4 x heads x head_dim`` FLOPs per key."""
    per_key = 4.0 * stats.num_heads * stats.head_dim
    seconds = 0.0
    for kernel, window in layer_kernels(stats, cp_backend, cp_size):
        keys = min(window, seq_len) if window else seq_len
        seconds += per_key * keys / (flash_rate * KERNEL_SPEED[kernel])
    return seconds


def attention_lines(stats: ModelStats, cp_backend: str, cp_size: int) -> list[str]:
    """The attention kernels assumed, for the step's printed assumptions."""
    kernels = layer_kernels(stats, cp_backend, cp_size)
    counts: dict[str, int] = {}
    for kernel, _ in kernels:
        counts[kernel] = counts.get(kernel, 0) + 1
    where = "no CP" if cp_size <= 1 else f"{cp_backend} CP"
    parts = []
    for kernel, count in counts.items():
        speed = "" if kernel == FLASH else f" at {KERNEL_SPEED[kernel]:.3f}x the flash rate"
        parts.append(f"{count} layer(s) on {kernel}{speed}")
    windowed = sum(1 for kernel, window in kernels if window)
    band = f"; {windowed} windowed layer(s) count their band" if windowed else ""
    square = (
        "; eager layers compute the whole seq x seq square (a window masked, not skipped)"
        if EAGER in counts
        else ""
    )
    return [f"attention ({where}): " + ", ".join(parts) + band + square]
