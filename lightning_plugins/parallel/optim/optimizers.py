"""The optimizers a recipe can name (``optim.name``): torch's AdamW and torchao's 8-bit AdamW.

``adamw8bit`` is ``torchao.optim.AdamW8bit``: both AdamW moments stored as 8-bit codes with one fp32 scale per
256 values (about 2 bytes per parameter instead of fp32 AdamW's 8), dequantized, updated and requantized inside a
``torch.compile``-d step. Tensors with fewer than 4096 values on a rank (norms, biases; any tensor whose local shard
is that small) keep fp32 moments, as bitsandbytes does. Under FSDP2 the state of a DTensor parameter is a DTensor
over the same mesh and placements whose local tensor quantizes the local shard, so a shard whose size is a multiple
of 256 quantizes exactly the blocks one process would; DCP saves and restores it like any optimizer state. It steps
on CPU tensors too, so ``memory.optimizer_offload`` can run it on the host.

The first step compiles the update (tens of seconds on a CPU, once per process); later steps reuse it.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["OPTIMIZER_NAMES", "STATE_BYTES_PER_PARAM", "optimizer_class", "state_nbytes"]

#: The names ``optim.name`` accepts.
OPTIMIZER_NAMES = ("adamw", "adamw8bit")

#: Bytes of optimizer state per trainable fp32 parameter: two fp32 moments; two 8-bit codes plus one fp32 scale per
#: 256-value block for each moment (2 + 8 / 256).
STATE_BYTES_PER_PARAM = {"adamw": 8.0, "adamw8bit": 2.0 + 2 * 4 / 256}


#: torchao's 8-bit block size, and the smallest tensor (values per rank) it quantizes.
_BLOCK, _SMALLEST = 256, 4096


def state_nbytes(name: str, local: torch.Tensor) -> int:
    """Bytes of the optimizer state ``name`` keeps for a parameter whose local shard is ``local`` (a step included)."""
    numel = local.numel()
    if name == "adamw8bit" and numel >= _SMALLEST and numel % _BLOCK == 0:
        return 2 * (numel + 4 * numel // _BLOCK) + 4  # two moments: 8-bit codes and an fp32 scale per block
    return 2 * numel * local.element_size() + 4  # exp_avg, exp_avg_sq in the parameter's dtype; a float32 step


def optimizer_class(name: str) -> type[Optimizer]:
    """The optimizer class for ``optim.name``.

    Raises:
        ValueError: for a name that is not in :data:`OPTIMIZER_NAMES`, or ``adamw8bit`` without torchao.
    """
    if name == "adamw":
        return torch.optim.AdamW
    if name == "adamw8bit":
        try:
            from torchao.optim import AdamW8bit
        except ImportError as error:
            raise ValueError(
                "optim.name: adamw8bit needs torchao (`pip install torchao`); or use optim.name: adamw."
            ) from error
        return _quiet(AdamW8bit)
    raise ValueError(f"optim.name={name!r} is not one of {OPTIMIZER_NAMES}.")




def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@functools.cache
def _quiet(cls: type[Optimizer]) -> type[Optimizer]:
    """torchao's 8-bit ``cls`` whose step updates the LOCAL tensors of sharded parameters and their state.

    torchao's own step compiles its update with DTensor arguments; the compiled code then keeps the mesh's process
    groups alive from C++ after they are destroyed (their gloo threads outlive the run and can race the interpreter's
    exit). The update is elementwise, so the local shards give the same numbers (``_new_buffer`` still makes the state
    DTensors, which is what checkpoints see). Also: a learning rate that a loaded state dict made a float again is
    made a tensor (torchao refuses a float: its compiled update would recompile per value), and the one harmless
    warning the compiled update raises in every new process is muted (torch's AOT-autograd cache asking torchao's
    state subclass for ``_stable_hash_for_caching``; it then just does not cache).
    """
    from torchao.optim.adam import single_param_adam

    @torch.no_grad()
    def step(self: Any, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with warnings.catch_warnings(), torch._dynamo.utils.disable_cache_limit():
            warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching", category=UserWarning)
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                        if group["amsgrad"]:
                            state["max_exp_avg_sq"] = self._new_buffer(p, False)
                    state["step"] += 1
                    torch.compile(single_param_adam, fullgraph=True, dynamic=False)(
                        _local(p.detach()), _local(p.grad), state["step"], _local(state["exp_avg"]),
                        _local(state["exp_avg_sq"]), _local(state.get("max_exp_avg_sq")), group["lr"],
                        group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], self.is_adamw,
                        self.bf16_stochastic_round and p.dtype is torch.bfloat16,
                    )  # fmt: skip
        return loss

    return type(cls.__name__, (cls,), {"step": step, "__module__": __name__, "__doc__": cls.__doc__})
