"""Tests of the data -> train contract: the shard format, the row planner, Parallel-R1's structures."""
