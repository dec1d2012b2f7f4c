"""Patches installed into a transformers model: per-sequence rope, recurrent restarts, tiled MLP, activation offload."""
