"""The target model running: the vLLM engine (arguments, defaults, the contract vx relies on, the KV
connector and worker extension that capture states, the capture hot path), its lifetime (reaper,
fast exit, logs), and the HF backend that is also the numerical reference."""
