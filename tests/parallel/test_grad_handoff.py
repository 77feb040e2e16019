"""The pipeline's gradient hand-off both doors use (``GradHandOff``): no process group needed."""

from __future__ import annotations

import torch
from torch import nn

from lightning_plugins.parallel.pipeline.runtime import GradHandOff


def test_a_call_s_gradients_are_kept_apart_and_added_to_the_earlier_ones() -> None:
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    earlier = torch.full_like(model.weight, 2.0)
    model.weight.grad = earlier.clone()
    handoff = GradHandOff()
    assert not handoff.add()  # no call yet: nothing to add (the Accelerate door raises on this)
    handoff.take()  # nothing held: nothing happens
    assert torch.equal(model.weight.grad, earlier)

    handoff.hold(model)
    assert model.weight.grad is None  # the call computes its own gradients from zero
    model(torch.ones(4, 3)).sum().backward()
    own = model.weight.grad.clone()
    handoff.take()
    assert torch.equal(model.weight.grad, earlier)  # the earlier ones are back until the door's backward
    assert handoff.add()
    torch.testing.assert_close(model.weight.grad, earlier + own, rtol=0, atol=0)
    assert model.bias.grad is None  # frozen parameters are left alone
    assert not handoff.add()  # added once only

    model.weight.grad = None
    handoff.hold(model)
    model(torch.ones(1, 3)).sum().backward()
    handoff.take()
    assert model.weight.grad is None
    assert handoff.add()
    torch.testing.assert_close(model.weight.grad, torch.ones_like(model.weight), rtol=0, atol=0)
