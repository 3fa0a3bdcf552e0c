"""An engine's lifetime beside the driver that started it: its processes die with the driver
(reaper), a dead or stuck engine is noticed and named in one line (liveness), the driver leaves
without waiting on vLLM's teardown (fast_exit), and its log goes to a file (logs)."""
