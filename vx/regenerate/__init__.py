"""`vx regenerate`: the target writes the assistant turns (config, engine loop, output, partitions)."""
