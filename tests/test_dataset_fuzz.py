"""Datasets as users have them, valid and broken, generated (hypothesis): `vx extract` keeps every
good record exactly once, reports every bad one in errors.jsonl with its line and a reason, never
prints a traceback; `--strict` stops before any compute with one line naming the first bad line.

The oracle is the generator's own bookkeeping (which line it made good or broken, and how), not
vx's reader. Each example is a real file and a real `vx extract --backend hf` process."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, machine_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=80)
MAX_LENGTH = 400  # --max-length with --overlong skip: a huge message is a bad record, reported


def good(i: int):
    return st.tuples(TEXT, TEXT).map(lambda t: {"id": f"g{i}", "messages": [
        {"role": "user", "content": t[0]}, {"role": "assistant", "content": t[1]}]})


# each broken kind: (a strategy for the line's bytes, what its reason must say)
BROKEN = {
    "bad-json": (TEXT.map(lambda t: ('{"id": "x", "messages": [' + json.dumps(t)).encode()), "invalid JSON"),
    "not-an-object": (st.lists(st.integers(), max_size=3).map(lambda v: json.dumps(v).encode()), "not a JSON object"),
    "messages-not-a-list": (TEXT.map(lambda t: json.dumps({"messages": t}).encode()), "not a list"),
    "content-not-a-string": (st.integers().map(lambda n: json.dumps(
        {"messages": [{"role": "user", "content": n}]}).encode()), "non-string content"),
    "empty-messages": (st.just(json.dumps({"messages": []}).encode()), "empty conversation"),
    "unknown-role": (st.sampled_from(["wizard", "bot", "USER"]).map(lambda r: json.dumps(
        {"messages": [{"role": r, "content": "hello"}]}).encode()), "unknown role"),
    "bad-utf8": (st.binary(min_size=1, max_size=6).map(lambda b: b'{"text": "' + b"\xff" + b + b'"}'), "UTF-8"),
    "huge": (st.integers(3000, 6000).map(lambda n: json.dumps(
        {"messages": [{"role": "user", "content": "word " * n}]}).encode()), "--max-length"),
    "out-of-vocabulary": (st.integers(10**6, 10**9).map(lambda n: json.dumps({"input_ids": [1, 2, n]}).encode()),
                          "outside the vocabulary"),
    "id-not-a-string": (st.just(json.dumps({"id": [1], "text": "hi"}).encode()), "must be a string or an integer"),
}


@st.composite
def datasets(draw):
    """(lines as bytes, {line number: the reason's words} for the broken ones, the good ids)."""
    n = draw(st.integers(4, 14))
    lines, bad, ids = [], {}, []
    for i in range(n):
        kind = draw(st.sampled_from(["good"] * 3 + sorted(BROKEN) + ["repeat"]))
        if kind == "good" or (kind == "repeat" and not ids):
            rec = draw(good(i))
            lines.append(json.dumps(rec, ensure_ascii=draw(st.booleans())).encode())
            ids.append(rec["id"])
        elif kind == "repeat":  # an id seen before: the later line is the bad one
            lines.append(json.dumps({"id": draw(st.sampled_from(ids)), "text": "again"}).encode())
            bad[len(lines)] = "duplicate id"
        else:
            strategy, says = BROKEN[kind]
            lines.append(draw(strategy))
            bad[len(lines)] = says
    return lines, bad, ids


def extract(data, out, *extra):
    env = dict(os.environ, VX_CACHE_DIR=machine_cache(out.parent / "cache"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "vx", "extract", str(data), "-o", str(out), "--backend", "hf",
                           "--max-length", str(MAX_LENGTH), "--overlong", "skip", "--shard-size", "0.5", "--json",
                           *extra], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def committed_ids(out) -> list[str]:
    return [s for line in (out / "manifest.jsonl").read_text().splitlines() for s in json.loads(line)["sample_ids"]]


@settings(max_examples=int(os.environ.get("VX_FUZZ_EXAMPLES", "4")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=datasets())
def test_good_records_once_bad_ones_reported_by_line_strict_stops_first(tmp_path_factory, tiny_model, case):
    lines, bad, ids = case
    d = tmp_path_factory.mktemp("fuzz")
    data = d / "d.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")

    r = extract(data, d / "out")
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    if not ids:  # nothing readable: one line, exit 2
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        return
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(committed_ids(d / "out")) == sorted(ids)  # every good record, exactly once
    errors = [json.loads(x) for x in (d / "out" / "errors.jsonl").read_text().splitlines()] if bad else []
    assert {e["line"]: e["reason"] for e in errors}.keys() == bad.keys(), (errors, bad)
    for e in errors:
        assert bad[e["line"]] in e["reason"], (e, bad[e["line"]])

    if bad:
        s = extract(data, d / "strict", "--strict")
        first = min(bad)
        [line] = s.stderr.strip().splitlines()
        assert s.returncode == 2 and f"d.jsonl:{first}" in line and "--strict" in line, s.stderr
        assert not (d / "strict").exists() or not list((d / "strict").glob("shard-*"))


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_a_compressed_file_cut_short_keeps_the_lines_before_the_cut_and_reports_the_cut(tmp_path, tiny_model, suffix):
    rows = [{"id": f"r{i}", "text": f"row {i} " + "x" * (i % 50)} for i in range(400)]
    if suffix.endswith(".gz"):
        packed = gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())
    else:
        import io

        import zstandard

        buf = io.BytesIO()  # blocks of 20 rows, as a long file has them (a block decodes whole or not at all)
        with zstandard.ZstdCompressor().stream_writer(buf, closefd=False) as z:
            for i in range(0, len(rows), 20):
                z.write("".join(json.dumps(r) + "\n" for r in rows[i:i + 20]).encode())
                z.flush(zstandard.FLUSH_BLOCK)
        packed = buf.getvalue()
    data = tmp_path / f"d{suffix}"
    data.write_bytes(packed[: len(packed) * 2 // 3])  # a download that stopped two thirds in

    r = extract(data, tmp_path / "out")
    assert "Traceback" not in r.stderr and r.returncode == 0, r.stderr[-3000:]
    got = committed_ids(tmp_path / "out")
    assert 0 < len(got) < len(rows)
    assert set(got) == {f"r{i}" for i in range(len(got))}  # a prefix of the file: every line before the cut
    [cut] = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert cut["line"] == len(got) + 1 and "cut short" in cut["reason"], cut
    s = extract(data, tmp_path / "strict", "--strict")
    assert s.returncode == 2 and "cut short" in s.stderr and len(s.stderr.strip().splitlines()) == 1, s.stderr
