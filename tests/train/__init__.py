"""Tests of the trainer (train/), a folder per wing: config, plan, model (and model/patches), attention, engines, steps,
run; the top-level modules (the loop, preflight, launch, checkpoints, metrics, ...) at this folder's top."""
