"""What data/ writes and train/ reads: the shard format, the row planner, the image loader, Parallel-R1's structures."""
