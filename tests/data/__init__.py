"""Tests of the data pipeline (data/): stages, executors, engines, the pack stage."""
