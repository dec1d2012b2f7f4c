"""A run's processes and machines: their layout, CPU threads, the heartbeat between machines, why a run stopped."""
