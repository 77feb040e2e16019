"""The memory levers applied to a model's layers: each trades compute (or nothing) for activation memory.

The parts: :mod:`.activation` (activation checkpointing: full, every N-th layer, selective; and offload),
:mod:`.norms` and :mod:`.gated_mlp` (the model's own norm and gated MLP, computed the same way, saving less),
:mod:`.tiled_mlp` (the MLP a tile of tokens at a time), :mod:`.chunked_loss` (cross entropy from the hidden states a
chunk of tokens at a time, never the full logits) and :mod:`.regather` (sequence-parallel regions that all-gather
their input again in backward instead of keeping it).
"""
