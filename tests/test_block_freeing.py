"""A finished request frees its KV blocks at once (issue 51 item 4): every group's, the GDN states
included (~300 MiB per request for a 27B hybrid), in the very update that finishes it, with vLLM's
own scheduler and with its async one (which a GPU runs; vLLM's CPU build turns async scheduling
off, so no engine test here can). vx's connector sends the worker each request in the step that
computes its last kept row, with the hidden-state blocks vLLM's KV cache manager gave it: the
worker gathers them before the next forward can reuse them.

Real parts: vLLM 0.32's Scheduler and AsyncScheduler over the KV cache config its planner makes
for the tiny hybrid model (config only, no weights), vx's connector on the scheduler side, vx's
request parameters. The model runner's output (one sampled token per request whose prefill ends)
is the only stand-in, stepped as the engine core steps (async: the next step scheduled before the
last one's output is processed).
"""

from __future__ import annotations

from collections import deque

import pytest

STEP = 48  # tokens per step: long prompts take several chunks


def scheduler(model_dir, async_scheduling: bool, blocks: int = 256):
    from vllm.engine.arg_utils import EngineArgs

    from vx.data.model import model_info
    from vx.engine import plan
    from vx.engine.vllm_engine import engine_kwargs

    info = model_info(model_dir)
    layers = [0, info.num_layers - 1]
    kw = engine_kwargs(model_dir, layers, on_cpu=True, max_model_len=256, max_num_batched_tokens=STEP,
                       max_num_seqs=8)
    config = EngineArgs(**kw).create_engine_config()
    p = plan.plan_engine(config, len(layers), info.hidden_size)
    return kv_scheduler(config, p, blocks, async_scheduling), p


def kv_scheduler(config, p, blocks: int, async_scheduling: bool):
    """vLLM's Scheduler (or AsyncScheduler) over `blocks` KV blocks of the plan's groups, built as
    the engine core builds it."""
    from vllm.v1.core.kv_cache_utils import (get_kv_cache_config_from_groups, get_kv_cache_groups,
                                             resolve_kv_cache_block_sizes)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from vx.engine import plan

    config.scheduler_config.async_scheduling = async_scheduling
    hidden = int(config.model_config.hf_text_config.hidden_size)
    specs, _ = plan.kv_cache_specs(config, p.hidden_bytes_per_token // (2 * hidden), hidden, p.attention_block)
    groups = get_kv_cache_groups(config, specs)
    kv = get_kv_cache_config_from_groups(config, groups, blocks * p.bytes_per_block)
    config.cache_config.num_gpu_blocks = kv.num_blocks  # as the engine core sets it
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, config)  # as the engine core does
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               block_size=block_size, hash_block_size=hash_block_size)


def requests(lengths):
    from vllm.v1.request import Request

    from vx.data.samples import Sample
    from vx.engine.vllm_engine import prompt_ids, request_params

    out = []
    for i, n in enumerate(lengths):
        s = Sample(f"s{i}", i + 1, list(range(3, 3 + n)), [1] * n)
        out.append(Request(f"vx-{i}", prompt_ids(s), request_params(s), None))
    return out


def runner_output(sched, so):
    """What a model runner returns for this step (asked right after it is scheduled): a token for
    each request whose prefill it ends."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(so.num_scheduled_tokens)
    sampled = [[] if sched.requests[r].is_prefill_chunk else [7] for r in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_request_is_sent_once_with_its_blocks_and_frees_them_in_the_update_that_finishes_it(
        tiny_model, async_scheduling):
    sched, p = scheduler(tiny_model, async_scheduling)
    connector = sched.connector
    group = connector._group
    lengths = [1, 5, 16, 47, 48, 49, 100, 130, 17, 3, 64, 200]
    reqs = requests(lengths)
    keep = {r.request_id: n for r, n in zip(reqs, lengths)}
    for r in reqs:
        sched.add_request(r)
    free_at_start = sched.kv_cache_manager.block_pool.get_num_free_blocks()

    sent: dict[str, list[int]] = {}
    expected_blocks: dict[str, list[int]] = {}
    in_flight: deque = deque()
    held_after_finish = []  # requests whose blocks outlived the update that finished them
    steps = 0
    while sched.has_requests() or in_flight:
        if sched.has_requests():
            so = sched.schedule()
            steps += 1
            assert steps < 200
            for f in so.kv_connector_metadata.complete:
                assert f.req_id not in sent, f"{f.req_id} sent twice"
                sent[f.req_id] = f.block_ids
                assert len(f.token_ids) == keep[f.req_id]
                assert sched.requests[f.req_id].num_computed_tokens >= keep[f.req_id]  # once this step ran
                expected_blocks[f.req_id] = sched.kv_cache_manager.get_block_ids(f.req_id)[group][
                    : -(-keep[f.req_id] // p.hidden_block)]
            in_flight.append((so, runner_output(sched, so)))
        if len(in_flight) == (2 if async_scheduling else 1) or not sched.has_requests():
            before = set(sched.requests)
            out = sched.update_from_output(*in_flight.popleft())
            finished = {o.request_id for outs in out.values() for o in outs.outputs if o.finish_reason}
            assert finished <= before
            held_after_finish += [r for r in finished if r in sched.requests]  # vLLM drops a request
            # from its table once its blocks are freed

    assert sorted(sent) == sorted(keep)
    assert sent == expected_blocks  # the hidden-state blocks vLLM's KV cache manager holds for each
    assert held_after_finish == []  # no request kept its blocks past the update that finished it
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_at_start


def test_a_warm_up_request_is_not_captured_and_frees_its_blocks(tiny_model):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sched, _ = scheduler(tiny_model, False)
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={"vx_warmup": True})
    sched.add_request(Request("warm", list(range(3, 40)), params, None))
    while sched.has_requests():
        so = sched.schedule()
        assert so.kv_connector_metadata.complete == []
        sched.update_from_output(so, runner_output(sched, so))
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free


def test_a_request_without_vx_sample_id_is_refused_rather_than_dropped(tiny_model):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sched, _ = scheduler(tiny_model, False)
    sched.add_request(Request("stray", list(range(3, 20)), SamplingParams(max_tokens=1), None))
    with pytest.raises(RuntimeError, match="no vx sample id"):
        sched.schedule()
