"""Tests of train/config/: the typed sections of the trainer's YAML, their rules and `--help`."""
