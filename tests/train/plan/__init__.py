"""Tests of train/plan/: the decisions made once at start (memory plan, layout)."""
