"""The model on packed rows: packed model, family support, composites, LM head, loss, MoE, LoRA, self-check, images."""
