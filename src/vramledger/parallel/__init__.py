"""Per-rank memory when training is spread over many GPUs: DDP, ZeRO-1/2/3, FSDP2, offload."""
