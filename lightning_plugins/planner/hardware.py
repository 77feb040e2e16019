"""GPUs and clusters the planner knows: memory, dense bf16 peak, and the links collectives run over.

Figures are datasheet numbers (peak FLOPs are dense, without 2:4 sparsity); link bandwidths are what
collectives achieve (NCCL "bus bandwidth"), which is about 80% of the nominal per-direction figure, and
are marked as such. Every figure can be overridden per cluster (:func:`cluster_from`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from lightning_plugins.errors import PlannerError

__all__ = ["GPU", "GPUS", "Cluster", "cluster_from", "parse_bytes", "peak_flops"]

GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator.

    Attributes:
        name: The name :data:`GPUS` knows it by.
        memory_bytes: Memory the device reports (``nvidia-smi``'s total), what a process can at most allocate.
        peak_flops: Dense bf16 tensor-core peak (FLOP/s, no sparsity).
        nvlink_bytes_per_s: Per GPU, one direction: the bus bandwidth collectives achieve between GPUs of one
            node (NVLink / Infinity Fabric; PCIe for cards without NVLink).
        pcie_bytes_per_s: Host <-> GPU copies (pinned memory), one direction, achievable.
        host_bytes_per_gpu: Host RAM per GPU of the usual node of such GPUs: a node's host memory when a recipe
            does not name it is this times the GPUs of the node.
    """

    name: str
    memory_bytes: int
    peak_flops: float
    nvlink_bytes_per_s: float
    pcie_bytes_per_s: float
    host_bytes_per_gpu: int


# Sources: NVIDIA H100 / H200 / A100 / L40S / L40 / RTX A6000 datasheets and the Ada (RTX 4090) whitepaper
# (dense bf16 = half the "with sparsity" figure; the 4090 and A6000 figures are bf16 with fp32 accumulate);
# (A10G: the A10 datasheet's 125 TFLOPS dense bf16, 24 GB GDDR6: 23028 MiB, PCIe 4.0 without NVLink);
# AMD Instinct MI300X datasheet (1307.4 TFLOPS dense bf16, 192 GB HBM3, 7 Infinity Fabric links of 64 GB/s).
# Memory: the MiB total nvidia-smi reports (H100 SXM 80GB: 81559 MiB; H200: 143771 MiB; A100: 81920/40960 MiB;
# L40S/L40: 46068 MiB; RTX 4090: 24564 MiB; RTX A6000: 49140 MiB), MI300X: 192 GiB (datasheet).
# Links, achievable: NVLink 4 (H100/H200) 450 GB/s per direction nominal -> 360 GB/s (nccl-tests all-gather /
# reduce-scatter bus bandwidth on 8-GPU HGX H100 nodes is 350-370 GB/s); NVLink 3 (A100) 300 -> 240 GB/s;
# MI300X 448 -> 300 GB/s (RCCL); PCIe cards without NVLink: PCIe 4.0 x16, 32 -> 20 GB/s through the host.
# Host copies: PCIe 5.0 x16 64 GB/s nominal -> 50 GB/s pinned (H100/H200/MI300X); PCIe 4.0 x16 32 -> 25 GB/s.
# Host RAM per GPU, of the usual node: DGX H100, DGX H200 and DGX A100 640GB carry 2 TB for 8 GPUs (256 GiB each),
# DGX A100 320GB 1 TB (128 GiB); cloud VMs of 8 such GPUs carry about as much or a little less. The others are
# estimates: 8 x MI300X platforms as HGX nodes; PCIe cards as 8-GPU cloud servers of them (L40S/L40 192 GiB, A10G
# 96 GiB per GPU) or as workstations (RTX A6000 128 GiB, RTX 4090 64 GiB). A recipe names its own
# (hardware.host_memory_gb), and should wherever its nodes differ.
GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        GPU("H100", 81559 * MIB, 989.4e12, 360e9, 50e9, 256 * GIB),
        GPU("H200", 143771 * MIB, 989.4e12, 360e9, 50e9, 256 * GIB),
        GPU("A100", 81920 * MIB, 312e12, 240e9, 25e9, 256 * GIB),
        GPU("A100-40GB", 40960 * MIB, 312e12, 240e9, 25e9, 128 * GIB),
        GPU("MI300X", 192 * GIB, 1307.4e12, 300e9, 50e9, 256 * GIB),
        GPU("L40S", 46068 * MIB, 362.05e12, 20e9, 25e9, 192 * GIB),
        GPU("L40", 46068 * MIB, 181.05e12, 20e9, 25e9, 192 * GIB),
        GPU("A6000", 49140 * MIB, 154.8e12, 20e9, 25e9, 128 * GIB),
        GPU("RTX4090", 24564 * MIB, 165.2e12, 20e9, 25e9, 64 * GIB),
        GPU("A10G", 23028 * MIB, 125e12, 20e9, 25e9, 96 * GIB),
    )
}
_ALIASES = {"H100-80GB": "H100", "H100-SXM": "H100", "H200-141GB": "H200", "A100-80GB": "A100", "RTX-4090": "RTX4090"}



def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the GPU ``torch.cuda.get_device_name()`` calls ``device_name``, for MFU.

    The first :data:`GPUS` entry whose name ``device_name`` contains (``"NVIDIA H100 80GB HBM3"`` is an H100);
    ``None`` for a GPU the table does not know.
    """
    return next((gpu.peak_flops for name, gpu in GPUS.items() if name in device_name), None)


#: Per-GPU bandwidth between nodes when not given: one 400 Gb/s NDR InfiniBand (or RoCE) NIC per GPU, 50 GB/s
#: nominal, 40 GB/s achieved by collectives (80%).
DEFAULT_INTER_NODE = 40e9


@dataclass(frozen=True)
class Cluster:
    """GPUs and how they are connected.

    Args:
        gpu: The accelerator.
        gpus: GPUs in all (the world size of a layout).
        gpus_per_node: GPUs that share a node (NVLink domain).
        gpu_memory_bytes: Memory per GPU to plan against; ``None`` takes ``gpu.memory_bytes``.
        host_memory_per_node_bytes: Host RAM per node (:mod:`lightning_plugins.planner.host_memory`); ``None`` takes
            ``gpu.host_bytes_per_gpu`` times ``gpus_per_node`` (2 TiB for 8 x H100).
        inter_node_bytes_per_s: Per GPU, one direction, achievable between nodes (default 40 GB/s: 400 Gb/s NDR).
        intra_node_bytes_per_s: Per GPU within a node; ``None`` takes ``gpu.nvlink_bytes_per_s``.
        mfu: Fraction of the dense bf16 peak the compute reaches; ``None`` takes the calibrated default of
            :mod:`lightning_plugins.planner.timing`.
    """

    gpu: GPU
    gpus: int = 8
    gpus_per_node: int = 8
    gpu_memory_bytes: int | None = None
    host_memory_per_node_bytes: int | None = None
    inter_node_bytes_per_s: float = DEFAULT_INTER_NODE
    intra_node_bytes_per_s: float | None = None
    mfu: float | None = None

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerError(f"Cluster {name}={value!r} must be a positive integer.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            whole = math.ceil(self.gpus / self.gpus_per_node) * self.gpus_per_node
            raise PlannerError(
                f"Cluster gpus={self.gpus} is not a whole number of nodes of gpus_per_node={self.gpus_per_node}. Use a"
                f" multiple of {self.gpus_per_node} (e.g. gpus={whole}), or set gpus_per_node."
            )
        for name in (
            "inter_node_bytes_per_s",
            "intra_node_bytes_per_s",
            "gpu_memory_bytes",
            "host_memory_per_node_bytes",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise PlannerError(f"Cluster {name}={value!r} must be positive.")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise PlannerError(f"Cluster mfu={self.mfu!r} must be a fraction in (0, 1], e.g. 0.35.")

    @property
    def nodes(self) -> int:
        """Nodes the GPUs span."""
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def memory(self) -> int:
        """Bytes per GPU to plan against."""
        return self.gpu_memory_bytes if self.gpu_memory_bytes is not None else self.gpu.memory_bytes

    @property
    def host_memory(self) -> int:
        """Host bytes per node to plan against."""
        if self.host_memory_per_node_bytes is not None:
            return self.host_memory_per_node_bytes
        return self.gpu.host_bytes_per_gpu * self.gpus_per_node

    @property
    def host_memory_source(self) -> str:
        """Where :attr:`host_memory` comes from, as the report says it."""
        if self.host_memory_per_node_bytes is not None:
            return "hardware.host_memory_gb / --host-memory"
        return (
            f"the default for {self.gpu.name} nodes, {self.gpu.host_bytes_per_gpu / GIB:.0f} GiB per GPU x"
            f" {self.gpus_per_node}; set hardware.host_memory_gb"
        )

    @property
    def intra_node(self) -> float:
        """Per-GPU collective bandwidth inside a node (bytes/s)."""
        return self.intra_node_bytes_per_s if self.intra_node_bytes_per_s is not None else self.gpu.nvlink_bytes_per_s

    def link(self, extent: int) -> tuple[str, float]:
        """The link a group of ranks uses, and its per-GPU bandwidth, given the group's ``extent``.

        ``extent`` is the span of consecutive ranks the group covers (its size times the product of the
        sizes of the mesh dimensions inside it). Consecutive ranks fill a node first, so a group whose
        extent fits in a node stays on NVLink; any other crosses nodes and is bound by the NICs.
        """
        if extent <= min(self.gpus_per_node, self.gpus):
            return "NVLink" if self.gpu.nvlink_bytes_per_s > self.gpu.pcie_bytes_per_s else "PCIe", self.intra_node
        return "inter-node", self.inter_node_bytes_per_s


_UNITS = {
    "": GIB,  # a bare number is GiB, as in --gpu-memory 80
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": MIB,
    "mib": MIB,
    "mb": 10**6,
    "g": GIB,
    "gib": GIB,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}


def parse_bytes(text: str | float) -> int:
    """Bytes from a size: ``"80GiB"``, ``"80GB"`` (10^9), ``"80G"`` (GiB), ``"24"`` or ``80`` (GiB), ``85899345920``.

    A bare number below 10^6 is GiB; a larger one is bytes.

    Raises:
        PlannerError: naming ``text`` and the accepted forms.
    """
    fix = "Give a size such as '80GiB', '80GB' (10^9 bytes), '80G' or 80 (GiB), or a byte count."
    if isinstance(text, bool):
        raise PlannerError(f"Memory size {text!r} is not a size. {fix}")
    if isinstance(text, (int, float)):
        number, unit = float(text), None
    elif isinstance(text, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
        if not match or match.group(2).lower() not in _UNITS:
            raise PlannerError(f"Memory size {text!r} is not understood. {fix}")
        number, unit = float(match.group(1)), match.group(2).lower()
    else:
        raise PlannerError(f"Memory size {text!r} ({type(text).__name__}) is not a size. {fix}")
    if not math.isfinite(number) or number <= 0:
        raise PlannerError(f"Memory size {text!r} must be positive. {fix}")
    if unit is None or unit == "":
        scale = GIB if number < 1e6 else 1
    else:
        scale = _UNITS[unit]
    return round(number * scale)


def cluster_from(
    gpu: str = "H100",
    gpus: int = 8,
    gpus_per_node: int = 8,
    gpu_memory: str | float | None = None,
    host_memory: str | float | None = None,
    **overrides: Any,
) -> Cluster:
    """A :class:`Cluster` of ``gpus`` GPUs named ``gpu`` (a key of :data:`GPUS`, case-insensitive).

    Args:
        gpu: ``"H100"``, ``"H200"``, ``"A100"``, ``"A100-40GB"``, ``"MI300X"``, ``"L40S"``, ``"L40"``,
            ``"A6000"``, ``"RTX4090"``.
        gpus: GPUs in all.
        gpus_per_node: GPUs per node.
        gpu_memory: Memory per GPU (see :func:`parse_bytes`); ``None`` takes the GPU's.
        host_memory: Host memory per node (see :func:`parse_bytes`); ``None`` takes the GPU's default per GPU times
            ``gpus_per_node``.
        overrides: Other :class:`Cluster` fields (``inter_node_bytes_per_s``, ``mfu``, ...).

    Raises:
        PlannerError: for an unknown GPU (listing the known ones) or an unknown override.
    """
    key = {name.lower(): name for name in GPUS}.get(str(gpu).lower()) or _ALIASES.get(str(gpu).upper())
    if key is None:
        raise PlannerError(
            f"Unknown GPU {gpu!r}. Known GPUs: {', '.join(GPUS)}. Use one of those, or the closest one and override"
            " gpu_memory (e.g. --gpu A100 --gpu-memory 40GiB)."
        )
    known = {f for f in Cluster.__dataclass_fields__} - {
        "gpu", "gpus", "gpus_per_node", "gpu_memory_bytes", "host_memory_per_node_bytes"
    }  # fmt: skip
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise PlannerError(f"cluster_from got unknown setting(s) {unknown}; the settings are {sorted(known)}.")
    memory = None if gpu_memory is None else parse_bytes(gpu_memory)
    host = None if host_memory is None else parse_bytes(host_memory)
    return Cluster(
        GPUS[key], gpus=gpus, gpus_per_node=gpus_per_node, gpu_memory_bytes=memory, host_memory_per_node_bytes=host,
        **overrides,
    )  # fmt: skip
