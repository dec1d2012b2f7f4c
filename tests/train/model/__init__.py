"""Tests of train/model/: the packed model, composites, LM head, loss, MoE, experts, LoRA, images, the self-check."""
