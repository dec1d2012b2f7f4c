"""Tests of train/model/patches/: per-sequence rope, recurrent restarts, tiled MLP, activation offload."""
