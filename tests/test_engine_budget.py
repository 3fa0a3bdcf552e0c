"""The capture engine's step budget (vx/engine/budget.py): tokens per step and max_num_seqs, chosen
before the engine starts from its memory plan and the token counts of the run's samples.

Checked against what the budget does not compute itself: counts over every stretch of samples by
brute force, and vLLM 0.32's own AsyncScheduler (what a GPU runs: async scheduling on) over the
KV cache config vLLM's planner makes for real targets' configs (config values only, no weights) at
real GPUs' memory, fed as vx's driver feeds it (in order, 2 x max_num_seqs in the engine) and
stepped as the engine core steps; a model runner's output (one token per finished prefill) is the
only stand-in, as in test_block_freeing.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from test_block_freeing import kv_scheduler, requests, runner_output
from test_engine_plan import GPUS, QWEN35_4B, QWEN36_27B, engine_config, write_config
from vx.engine.budget import FILL_MISS, choose_budget, device_step, requests_to_fill
from vx.engine.plan import gpu_attention_block, plan_engine

VLLM_DEFAULT = (16384, 1024)  # vLLM's offline step and max_num_seqs on a GPU of 70 GB or more


def chat_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Chat-like token counts: log-normal, mean ~335, 2 to 3,300 tokens, in no particular order."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(335) - 0.5, 1.0, n).astype(int), 2, 3300)


def fewest_that_fill(lengths, step: int, miss: float = FILL_MISS) -> int:
    """By brute force: the fewest consecutive samples reaching `step` tokens in all but `miss` of
    the stretches (every start), + 1; all of them where the whole run is shorter than a step."""
    lengths = [int(x) for x in lengths]
    if sum(lengths) < step:
        return len(lengths)
    for k in range(1, len(lengths) + 1):
        sums = [sum(lengths[i:i + k]) for i in range(len(lengths) - k + 1)]
        if sum(s < step for s in sums) <= miss * len(sums):
            return min(len(lengths), k + 1)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("seed", range(6))
def test_max_num_seqs_covers_the_runs_stretches_of_short_samples(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, [5, 50, 400, 2000, 3300, 20][seed], size=int(rng.integers(30, 300)))
    for step in (64, 512, 4096):
        assert requests_to_fill(lengths, step) == fewest_that_fill(lengths, step), (seed, step)
    assert requests_to_fill(lengths[:3], 10**9) == 3  # a run shorter than a step: all of it
    assert requests_to_fill(None, 16384) == 16384 // 64 + 1  # unknown lengths: 64-token samples


def test_async_scheduling_doubles_the_requests_and_a_users_values_are_kept():
    lengths = chat_lengths(2000)
    sync = choose_budget(None, lengths, 16384, async_scheduling=False)
    both = choose_budget(None, lengths, 16384, async_scheduling=True)
    assert (sync.step_tokens, sync.max_num_seqs) == (16384, fewest_that_fill(lengths, 16384))
    assert (both.step_tokens, both.max_num_seqs) == (16384, 2 * sync.max_num_seqs)
    assert "async scheduling" in both.line and "async" not in sync.line
    user = choose_budget(None, lengths, 16384, async_scheduling=True, step=4096, seqs=7)
    assert (user.step_tokens, user.max_num_seqs) == (4096, 7)
    assert device_step(True) == 16384 and device_step(False, 141 * 10**9, "NVIDIA H200") == 16384
    assert device_step(False, 80 * 2**30, "NVIDIA A100-SXM4-80GB") == 8192 == device_step(False, 48 * 2**30, "L40S")


def run_scheduler(config, plan, step: int, seqs: int, lengths) -> tuple[np.ndarray, int]:
    """vLLM's AsyncScheduler over the plan's blocks: the tokens of each step, and how many
    requests were preempted (their prefill computed again)."""
    config.scheduler_config.max_num_batched_tokens = config.scheduler_config.max_num_scheduled_tokens = step
    config.scheduler_config.max_num_seqs = seqs
    sched = kv_scheduler(config, plan, plan.num_blocks, async_scheduling=True)
    reqs = requests(lengths)
    pending, in_flight, steps = deque(reqs), deque(), []
    submitted = done = 0
    while done < len(reqs):
        while pending and submitted - done < 2 * seqs:  # vx's driver: 2 x max_num_seqs in the engine
            sched.add_request(pending.popleft())
            submitted += 1
        if sched.has_requests():
            so = sched.schedule()
            steps.append(so.total_num_scheduled_tokens)
            in_flight.append((so, runner_output(sched, so)))
        if len(in_flight) == 2 or (in_flight and not sched.has_requests()):
            out = sched.update_from_output(*in_flight.popleft())
            done += sum(1 for outs in out.values() for o in outs.outputs if o.finish_reason)
        assert len(steps) < 10 * len(reqs)
    return np.array(steps), sum(r.num_preemptions for r in reqs)


@pytest.mark.parametrize("gpu,name,spec,memory_binds", [
    ("H200", "27B", QWEN36_27B, False), ("RTX PRO 6000", "27B", QWEN36_27B, True),
    ("H100", "27B", QWEN36_27B, True), ("H100", "4B", QWEN35_4B, False)])
def test_on_real_targets_steps_are_as_full_as_vllms_defaults_make_them_with_a_fraction_of_the_requests(
        tmp_path, gpu, name, spec, memory_binds):
    """Where two full 16,384-token steps fit the blocks, the budget keeps vLLM's step and every
    step is (nearly) full; where they do not (27B on one H100 or RTX PRO 6000), it takes a step
    the blocks can fill and the line names the remedy. Either way vLLM's own scheduler computes
    as many tokens a step as with vLLM's defaults (1,024 requests, whose sampler logits vLLM
    profiles and takes from the KV cache), preempting no request."""
    lengths = chat_lengths(1500)
    config = engine_config(write_config(tmp_path, spec), 1, int(lengths.max()) + 1)
    blocks_bytes = int(GPUS[gpu] * 0.9 - spec["weights_gb"] * 1e9 - 4e9)  # less the weights and 4 GB activations
    plan = plan_engine(config, 5, spec["hidden_size"], available_bytes=blocks_bytes,
                       attention_block=gpu_attention_block(config))
    budget = choose_budget(plan, lengths, device_step(False, GPUS[gpu]), async_scheduling=True)
    ours, preempted = run_scheduler(config, plan, budget.step_tokens, budget.max_num_seqs, lengths)
    theirs, _ = run_scheduler(config, plan, *VLLM_DEFAULT, lengths)
    assert preempted == 0
    assert ours.mean() >= 0.97 * theirs.mean(), (budget.line, ours.mean(), theirs.mean())
    assert budget.max_num_seqs <= VLLM_DEFAULT[1] // 4, budget.line
    assert ("more memory (--gpu-memory-utilization, --tensor-parallel-size) fills the step" in budget.line) == memory_binds
    if memory_binds:
        assert budget.step_tokens < VLLM_DEFAULT[0]
    else:
        assert budget.step_tokens == VLLM_DEFAULT[0]
        assert np.mean(ours[:-3]) >= 0.9 * budget.step_tokens, budget.line  # the last steps drain the run
