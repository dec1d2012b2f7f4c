"""Tests of train/steps/: micro-batches, the feed, online packing, dp balance."""
