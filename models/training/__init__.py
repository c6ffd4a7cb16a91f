"""What a run adds to a built model: LoRA adapters, fp8 linears, FSDP units and activation
checkpointing, torch.compile."""
