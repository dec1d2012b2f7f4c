"""What each step trains on: the sampler, micro-batches, the feed that builds them, online packing, dp balance."""
