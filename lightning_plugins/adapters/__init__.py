"""LoRA and QLoRA: peft adapters on parallelized models, NF4 base weights."""
