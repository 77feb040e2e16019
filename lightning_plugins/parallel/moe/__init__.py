"""Mixture of experts: the routed experts split over ranks, and what keeps them balanced.

The parts: :mod:`.experts` (the grouped experts forward, expert parallelism over the ``ep`` ranks drawn from
``dp_shard x cp``, the expert meshes), :mod:`.expert_adapters` (peft's LoRA on the fused expert weights, run inside
that forward), :mod:`.experts_balance` (the tokens each expert receives, per step) and :mod:`.router_loss` (the
router's load-balancing loss over the global batch).
"""
