"""The engines that apply and save a step (plain torch, DeepSpeed, FSDP2), each with its checkpoint format."""
