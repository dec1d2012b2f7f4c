"""Tests of train/run/: the run around the loop (resume, resharding, the experts' regrouping)."""
