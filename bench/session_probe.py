"""Probe: can one engine run generate an assistant turn and capture the whole final conversation's
rows, decode rows included, on vLLM's maintained contract? One streaming-input session per
conversation (vLLM's resumable requests, `AsyncLLM.generate` with `StreamingInput`, the same in
0.32 and 0.33) on vx's engine (the extract_hidden_states method + vx's connector and worker):
chunk 1 is the rendered prompt, generated with sampling; chunk 2 is what the template's
rendering of the regenerated conversation adds after the tokens the session fed (the last
generated token and the template's tail), with max_tokens=1 and vx's capture fields; when the
session ends, vx's connector captures every row of it. Each conversation is then held against
the fp32 HF forward of the rendered ids (vx's Reference and bound).

Where the generated ids do not round-trip through the template (the tiny random model's tokens
often do not), the session's ids are not the rendering's: those rows are the wrong rows and the
one-pass mode must prefill the rendering instead (the probe reports them, match False).

    python bench/session_probe.py [conversations] [max_tokens]
"""
import asyncio, os, sys, time, tempfile
from pathlib import Path
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vx.device import engine_env
engine_env()
import torch  # noqa: F401  (torch before vLLM, as vx imports them)
from vx.data.tiny import default_model_dir
from vx.data.model import load_tokenizer, model_info
from vx.data.layers import default_layer_ids
from vx.data.chat import ChatTemplate
from vx.engine.vllm_engine import engine_kwargs
from vx.engine.capture import capture_budget

model = default_model_dir()
info = model_info(model)
layers = default_layer_ids(info.num_layers)
tok = load_tokenizer(model)
chat = ChatTemplate(tok)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 6
MAXTOK = int(sys.argv[2]) if len(sys.argv) > 2 else 24
out = Path(tempfile.mkdtemp(prefix="vx-session-probe-"))

async def main():
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.engine.protocol import StreamingInput
    from vllm import SamplingParams
    kw = engine_kwargs(model, layers, on_cpu=True, gpu_memory_utilization=0.05)
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    b = capture_budget(4096, len(layers), info.hidden_size, "bf16", shard_bytes=1 << 30)
    await llm.collective_rpc("vx_begin", args=(str(out), {"model": "probe"}, 1 << 30, 0, len(layers), info.hidden_size,
                                               "bf16", None, None, b["ring_bytes"], b["chunk_rows"], b["hold_bytes"]))
    results = {}

    async def conv(i):
        msgs = [{"role": "user", "content": f"Tell me fact number {i} about the sea, please."}]
        p = tok(chat.render(msgs, gen=True), add_special_tokens=False)["input_ids"]
        turn_done = asyncio.Event()
        state = {}

        async def inputs():
            yield StreamingInput({"prompt_token_ids": p}, SamplingParams(max_tokens=MAXTOK, temperature=0.8, seed=i,
                                                                       extra_args={"vx_warmup": 1}))
            await turn_done.wait()
            fed = p + state["gen"][:-1]
            text = tok.decode(state["gen"], skip_special_tokens=True)
            R = tok(chat.render(msgs + [{"role": "assistant", "content": text}]), add_special_tokens=False)["input_ids"]
            state["R"], state["fed"] = R, fed
            state["match"] = R[:len(fed)] == fed
            tail = R[len(fed):]
            mask = bytes([0] * len(p) + [1] * (len(R) - len(p)))
            yield StreamingInput({"prompt_token_ids": tail}, SamplingParams(max_tokens=1, temperature=0,
                                 extra_args={"vx_id": f"c{i}", "vx_line": i, "vx_mask": mask, "vx_keep": len(R)}))

        n = 0
        async for o in llm.generate(inputs(), SamplingParams(max_tokens=MAXTOK), request_id=f"conv{i}"):
            n += 1
            if o.finished or (o.outputs and o.outputs[0].finish_reason):
                if "gen" not in state:
                    state["gen"] = list(o.outputs[0].token_ids)
                    state["reason"] = o.outputs[0].finish_reason
                    turn_done.set()
        results[i] = state

    t = time.perf_counter()
    await asyncio.gather(*(conv(i) for i in range(N)))
    print("sessions done", time.perf_counter() - t, file=sys.stderr)
    for _ in range(200):
        st = (await llm.collective_rpc("vx_status"))[0]
        if st.get("received", 0) >= N:
            break
        await asyncio.sleep(0.05)
    stats = (await llm.collective_rpc("vx_finish"))[0]
    llm.shutdown()
    return results, stats

def report():
    results, stats = asyncio.run(main())
    print("stats", {k: v for k, v in stats.items() if k != "rejected"}, stats.get("rejected"))
    import vx
    from vx.engine.reference import Reference, model_type_of
    ds = vx.open_dataset(out)
    ref = Reference(model, layers, model_type_of(model))
    for i, st in sorted(results.items()):
        sid = f"c{i}"
        line = {"id": sid, "gen": len(st["gen"]), "reason": st["reason"], "match": st["match"], "R": len(st["R"])}
        if sid in ds.ids:
            rec = ds[sid]
            line["ids_equal_R"] = rec["input_ids"].tolist() == st["R"]
            rows = ref.check(sid, st["R"], rec["hidden_states"])
            line["min_cos"] = round(min(r["cosine"] for r in rows), 5)
            line["ok"] = all(r["ok"] for r in rows)
            h = rec["hidden_states"].float()
            line["zero_rows"] = int((h.abs().amax(dim=(1, 2)) == 0).sum())
        else:
            line["captured"] = False
        print(line)

if __name__ == "__main__":
    report()
