"""Jobs the CLI calls: extract (one engine, data parallel on a node, Ray), verify, selftest."""
