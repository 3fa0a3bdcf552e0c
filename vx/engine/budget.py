"""The capture engine's step budget: tokens per step (max_num_batched_tokens) and requests per step
(max_num_seqs), chosen before the engine starts from its memory plan (vx/engine/plan.py) and the
token counts of the samples this run submits, in the order it submits them.

vLLM's scheduler fills a prefill-only step first come, first served: the driver's samples in
order (and the rest of a long one, chunked), until the step's tokens, max_num_seqs or the free
KV blocks run out (a request that finds no blocks waits; vLLM's own AsyncScheduler over a 27B
plan preempted none, tests/test_engine_budget.py).
- **Requests.** Enough that the run's stretches of short samples fill a step: the fewest
  consecutive samples whose tokens reach the step in all but FILL_MISS of the stretches, + 1 (the
  chunk of a long sample carried over). With async scheduling (on by default on CUDA) the
  requests of the step in flight still count against max_num_seqs when the next one is scheduled,
  so twice that. More costs memory: vLLM profiles the sampler's fp32 logits for max_num_seqs
  requests (0.33 `profile_run` -> `_dummy_sampler_run`): ~1 GB a copy at vLLM's default of 1,024
  requests and a 248k vocabulary, taken from the KV cache.
- **Step.** vLLM's own offline default for the device (16,384 tokens on a GPU of 70 GB or more,
  other than an A100; 8,192 below; vx's 16,384 on CPU, bench/throughput.py --step). Two steps
  hold blocks at once (the one in flight frees its finished requests' after the next is
  scheduled): each request its GDN states (a fixed count of blocks whatever its length; ~300 MiB
  for a 27B target) and each token its attention and hidden-state blocks. Where two full steps do
  not fit the plan's blocks and the KV cache is what profiling a step leaves (a GPU), vx takes the
  step (a multiple of STEP_GRAIN, down to MIN_STEP) whose requests, as many as the blocks hold,
  compute the most tokens a step on this run's samples: a larger one would profile activation
  memory no step uses.
A step or count the user gives is kept; the line says what two full steps hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vx.engine.plan import EnginePlan

FILL_MISS = 0.01     # the share of the run's stretches of samples allowed to leave a step short
MIN_STEP = 1024      # the smallest step tried where memory binds
STEP_GRAIN = 256     # steps tried where memory binds: multiples of this
MAX_SEQS = 1024      # vLLM's own largest default
SHORT_SAMPLE = 64    # tokens of the samples a step is counted for when their lengths are unknown
MEAN_SAMPLE = 335    # and of an average one, for the tokens a step computes


@dataclass
class Budget:
    step_tokens: int
    max_num_seqs: int
    line: str


def device_step(on_cpu: bool, device_bytes: int | None = None, device_name: str = "") -> int:
    """vLLM's offline default step for this device (0.32 and 0.33 `EngineArgs`), vx's 16,384 on CPU."""
    if on_cpu:
        return 16384
    big = device_bytes is not None and device_bytes >= 70 * 2**30 and "a100" not in device_name.lower()
    return 16384 if big else 8192


def requests_to_fill(lengths: np.ndarray | None, step: int, miss: float = FILL_MISS) -> int:
    """The fewest consecutive samples (in submission order) whose tokens reach `step` in all but
    `miss` of the run's stretches, + 1 for a long sample's carried-over chunk; all of them where
    the whole run is shorter than a step. Unknown lengths: a step of SHORT_SAMPLE-token samples."""
    if lengths is None or not len(lengths):
        return -(-step // SHORT_SAMPLE) + 1
    n = len(lengths)
    csum = np.concatenate(([0], np.cumsum(np.asarray(lengths, dtype=np.int64))))  # [n + 1]
    if csum[-1] < step:
        return n

    def short_share(k: int) -> float:  # stretches of k samples whose tokens fall short of a step
        return float(np.mean(csum[k:] - csum[:-k] < step))

    lo, hi = 1, n  # short_share is non-increasing in k; short_share(n) == 0
    while lo < hi:
        mid = (lo + hi) // 2
        if short_share(mid) <= miss:
            hi = mid
        else:
            lo = mid + 1
    return min(n, lo + 1)


def blocks_for_steps(plan: EnginePlan, step: int, seqs: int, steps: int = 2) -> int:
    """Blocks `steps` steps of `seqs` requests and `step` tokens hold at most: each request its GDN
    states and a part-filled block per token group, each token its share of every token group's."""
    per_request = sum(1 + plan.gdn_spare_blocks if kind == "gdn" else 1 for kind, _, _ in plan.groups)
    per_step = seqs * per_request + sum(-(-step // bs) for kind, _, bs in plan.groups if kind != "gdn")
    return steps * per_step


def tokens_per_step(lengths: np.ndarray | None, step: int, seqs: int) -> float:
    """The tokens a step of `step` tokens and `seqs` requests computes on average over the run's
    stretches of samples (unknown lengths: MEAN_SAMPLE tokens each)."""
    if lengths is None or not len(lengths):
        return float(min(step, seqs * MEAN_SAMPLE))
    csum = np.concatenate(([0], np.cumsum(np.asarray(lengths, dtype=np.int64))))
    k = min(seqs, len(lengths))
    return float(np.mean(np.minimum(step, csum[k:] - csum[:-k])))


def choose_budget(plan: EnginePlan | None, lengths: np.ndarray | None, start_step: int, async_scheduling: bool,
                  step: int | None = None, seqs: int | None = None, profiled: bool = True) -> Budget:
    """The step and max_num_seqs for this engine (the user's where given), and their line.
    profiled: the KV cache gets what the profile of a full step leaves (a GPU's), so a smaller
    step where memory binds leaves it more; else (a CPU's explicit size) the step is kept."""
    capacity = None if plan is None or plan.num_blocks is None else plan.num_blocks - 1  # vLLM's null block
    in_flight = 2 if async_scheduling else 1  # steps whose requests count against max_num_seqs

    def per_step(s: int) -> int:  # requests that fill a step of s tokens
        return max(1, min(MAX_SEQS // in_flight, requests_to_fill(lengths, s)))

    def fit(s: int) -> int:  # requests a step of s tokens may take with two such steps in the blocks
        room = capacity // 2 - blocks_for_steps(plan, s, 0, steps=1)
        return max(1, room // blocks_for_steps(plan, 0, 1, steps=1))

    chosen = start_step if step is None else step
    binds = capacity is not None and blocks_for_steps(plan, chosen, per_step(chosen)) > capacity
    if binds and step is None and profiled:
        # the step whose requests, as many as two steps' blocks hold, compute the most tokens a step
        chosen = max(range(chosen, MIN_STEP - 1, -STEP_GRAIN),
                     key=lambda s: (tokens_per_step(lengths, s, fit(s)), -s))
    want = per_step(chosen)
    n = seqs if seqs is not None else min(chosen, in_flight * want)  # vLLM: no more requests than tokens
    fills = (f"in {1 - FILL_MISS:.0%} of this run's stretches of samples" if lengths is not None and len(lengths)
             else f"of {SHORT_SAMPLE}-token samples (lengths unknown)")
    why = [] if seqs is not None else [f"{want:,} requests fill a step {fills}" + (
        f"; x{in_flight}: async scheduling counts the step in flight's" if in_flight > 1 else "")]
    if capacity is not None:
        held = blocks_for_steps(plan, chosen, want, steps=2)
        why.append(f"two full steps hold at most {held:,} of {capacity:,} KV blocks")
        if held > capacity:
            why.append(f"the blocks hold two steps of {fit(chosen):,} requests: about "
                       f"{tokens_per_step(lengths, chosen, fit(chosen)):,.0f} tokens a step on this run's samples; "
                       "more memory (--gpu-memory-utilization, --tensor-parallel-size) fills the step")
    line = f"step {chosen:,} tokens, max_num_seqs {n:,}"
    return Budget(chosen, n, line + (f" ({'; '.join(why)})" if why else ""))
