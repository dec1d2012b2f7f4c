"""Tests of train/engines/: DeepSpeed, FSDP2 and their checkpoint formats, the DeepSpeed dict, the lr schedule."""
