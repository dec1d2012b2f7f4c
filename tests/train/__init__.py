"""Tests of the trainer (train/): config, plans, model, attention, engines, steps, the loop."""
