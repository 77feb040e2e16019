"""The user's optimizers pointed at the parameters parallelizing made: each parameter found again by any of its names.

``prepare`` replaces the model's parameters (sharded into DTensors, moved into pipeline stages); an optimizer built
before it still holds the old ones and would train nothing. Names survive the wrapping (checkpointing, compile and
FSDP1 insert a level into them, left out here), and a tied embedding answers to each of its names.
"""

from __future__ import annotations

import re

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_plugins.errors import LayoutError

__all__ = ["parameter_names", "repoint_optimizers"]

# Wrappers that insert a level into parameter names; the optimizer's parameters are matched by name.
_WRAPPER_NAMES = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")

#: ``id(parameter) -> (parameter, all its names)``.
ParameterNames = dict[int, tuple[Tensor, list[str]]]


def _canonical(name: str) -> str:
    return _WRAPPER_NAMES.sub("", name)


def parameter_names(model: nn.Module) -> ParameterNames:
    """Each parameter of ``model`` with all its names (a tied parameter has several), wrappers left out."""
    names: ParameterNames = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), (param, []))[1].append(_canonical(name))
    return names


def repoint_optimizers(
    owner: str, model: nn.Module, before: ParameterNames, optimizers: list[Optimizer], *, pipeline: bool
) -> dict[int, Tensor]:
    """Point every optimizer's groups at the parameters ``model`` holds now under the names ``before`` had.

    Under pipeline parallelism a rank keeps only its stages' parameters: the others leave the groups.

    Returns:
        ``id(old parameter) -> old parameter`` for each one replaced.

    Raises:
        LayoutError: a parameter of an optimizer is under none of its names any more (without a pipeline).
    """
    params = {_canonical(name): p for name, p in model.named_parameters(remove_duplicate=False)}
    now = {key: next((params[n] for n in aliases if n in params), None) for key, (_, aliases) in before.items()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            lost = sorted(before[id(p)][1][0] for p in group["params"] if id(p) in now and now[id(p)] is None)
            if lost and not pipeline:
                raise LayoutError(f"{owner}.prepare: parameters {lost[:3]} vanished while parallelizing the model.")
            # Under pipeline parallelism each rank's optimizer keeps only its stages' parameters; a tied embedding
            # is found by any of its names (the first stage keeps the embedding's, the last stage the head's).
            group["params"] = [now.get(id(p), p) for p in group["params"] if now.get(id(p), p) is not None]
    return {key: p for key, (p, _) in before.items() if now[key] is not p}
