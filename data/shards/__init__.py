"""What data/ writes and train/ reads: the shard format, the row planner, the media and image loaders, Parallel-R1's structures."""
