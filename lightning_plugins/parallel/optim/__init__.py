"""Optimizer work beside the model: where the optimizer step runs, when, and with which state.

The parts: :mod:`.offload` (the optimizer step on the host, ZeRO-Offload style, and saved activations on it),
:mod:`.optim_in_backward` (each parameter stepped as soon as backward produced its gradient) and :mod:`.optimizers`
(the optimizers a recipe can name: torch's AdamW and torchao's 8-bit AdamW).
"""
