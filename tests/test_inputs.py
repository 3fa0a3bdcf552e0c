"""What users feed vx: every format they ship chat sets in reads as the same samples, in a stable
order, with bad records located by file and row; a run that can read nothing fails loudly."""

import gzip
import json

import pytest

from conftest import write_jsonl
from test_cli import vx_cmd
from vx.data.samples import BadLine, Sample, Tokenize, read_samples
from vx.launch.plan import make_plan

ROWS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 5)},
                                     {"role": "assistant", "content": f"answer {i} " * (2 + i % 7)}]}
        for i in range(40)]


def expected(tokenizer, rows=ROWS):
    """The reference: each record tokenized straight from the Python list, in order."""
    tok = Tokenize(tokenizer)
    return [(r["id"], *tok(r)) for r in rows]


def got(items):
    assert all(isinstance(i, Sample) for i in items), [i for i in items if isinstance(i, BadLine)]
    return [(s.id, s.input_ids, s.loss_mask) for s in items]


def write_formats(tmp_path):
    """The same 40 records in every format users ship: path per format."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    from datasets import Dataset

    lines = b"".join(json.dumps(r).encode() + b"\n" for r in ROWS)
    out = {"jsonl": write_jsonl(tmp_path / "d.jsonl", ROWS)}
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(lines))
    out["gz"] = tmp_path / "d.jsonl.gz"
    (tmp_path / "misnamed.jsonl").write_bytes(gzip.compress(lines))  # sniffed, not trusted by name
    out["gz named .jsonl"] = tmp_path / "misnamed.jsonl"
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    out["zst"] = tmp_path / "d.jsonl.zst"
    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    out["parquet"] = tmp_path / "d.parquet"
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hfds"), max_shard_size="2KB")  # several arrow files
    out["datasets dir"] = tmp_path / "hfds"
    split = tmp_path / "split"
    split.mkdir()
    for k in range(4):  # mixed formats in one directory, read in name order
        part = b"".join(json.dumps(r).encode() + b"\n" for r in ROWS[k * 10:(k + 1) * 10])
        if k == 2:
            pq.write_table(pa.Table.from_pylist(ROWS[20:30]), split / "part-2.parquet")
        else:
            (split / f"part-{k}.jsonl.gz").write_bytes(gzip.compress(part))
    out["directory"] = split
    out["glob"] = str(split / "part-*")
    return out


def test_every_format_reads_as_the_same_samples_in_the_same_order(tokenizer, tmp_path):
    want = expected(tokenizer)
    for name, path in write_formats(tmp_path).items():
        assert got(list(read_samples(path, tokenizer))) == want, name


def test_an_s3_object_and_an_s3_prefix_stream_as_the_local_files_do(tokenizer, tmp_path, monkeypatch):
    from test_s3 import CREDS, start_s3
    from s3_faults import free_port
    from vx.data.inputs import Input

    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    server, url, client = start_s3(free_port())
    try:
        files = write_formats(tmp_path)
        client.create_bucket(Bucket="data")
        client.upload_file(str(files["zst"]), "data", "one/d.jsonl.zst")
        for p in sorted(files["directory"].iterdir()):
            client.upload_file(str(p), "data", f"many/{p.name}")
        want = expected(tokenizer)
        assert got(list(read_samples(Input("s3://data/one/d.jsonl.zst", url), tokenizer))) == want
        assert got(list(read_samples(Input("s3://data/many/", url), tokenizer))) == want
        assert got(list(read_samples(Input("s3://data/many", url), tokenizer))) == want
    finally:
        server.stop()


def test_bad_records_are_located_by_file_and_row_and_rows_number_across_files(tokenizer, tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    write_jsonl(d / "a.jsonl", ROWS[:3])
    write_jsonl(d / "b.jsonl", [ROWS[3], "{broken", ROWS[4]])
    items = list(read_samples(d, tokenizer))
    [bad] = [i for i in items if isinstance(i, BadLine)]
    assert bad.to_json()["file"] == "b.jsonl" and bad.to_json()["row"] == 2 and bad.line == 5
    assert [i.line for i in items if isinstance(i, Sample)] == [1, 2, 3, 4, 6]


def test_the_partition_plan_of_a_parquet_directory_equals_the_plan_of_the_same_jsonl(tiny_model, tmp_path):
    files = write_formats(tmp_path)
    assert make_plan(files["directory"], tiny_model, 3, procs=2).tolist() == \
        make_plan(files["jsonl"], tiny_model, 3, procs=1).tolist()


def test_ids_below_the_embedding_size_are_accepted_even_past_the_tokenizer(tiny_model, tokenizer, tmp_path):
    import json as j

    rows = j.loads((tiny_model / "config.json").read_text())
    vocab = (rows.get("text_config") or rows)["vocab_size"]
    assert vocab > len(tokenizer)  # the tiny model, like Qwen3.6, has more embedding rows than tokens
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "edge", "input_ids": [1, len(tokenizer), vocab - 1]},
                                             {"id": "past", "input_ids": [1, vocab]},
                                             {"id": "neg", "input_ids": [1, -1]}])
    r = vx_cmd("extract", str(data), "-o", str(tmp_path / "out"), "--backend", "hf", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples"] == 1
    errors = [j.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert {e["id"] for e in errors} == {"past", "neg"}
    assert all(f"[0, {vocab})" in e["reason"] for e in errors)


def test_renamed_fields_are_read_with_the_field_flags(tokenizer, tmp_path):
    rows = [{"uid": "a", "conversation": ROWS[0]["messages"]}, {"uid": "b", "body": "plain text here"}]
    items = list(read_samples(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, messages_field="conversation",
                              id_field="uid", text_field="body"))
    tok = Tokenize(tokenizer)
    assert got(items) == [("a", *tok(ROWS[0])), ("b", *tok({"text": "plain text here"}))]
    items = list(read_samples(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer))  # without the flags
    assert all(isinstance(i, BadLine) and "--messages-field" in i.reason for i in items)


@pytest.mark.parametrize("content, looks", [
    (b"id,prompt,response\n1,hi,hello\n2,bye,see you\n", "CSV/TSV text"),
    (json.dumps(ROWS[:3]).encode(), "one JSON array"),
    (b"\x00\x01\x02\xff\xfe" * 40, "binary data"),
])
def test_a_run_that_can_read_no_record_exits_2_saying_what_the_file_looks_like(content, looks, tmp_path, tiny_model):
    (tmp_path / "d.jsonl").write_bytes(content)
    r = vx_cmd("extract", str(tmp_path / "d.jsonl"), "-o", str(tmp_path / "out"), "--backend", "hf")
    assert r.returncode == 2, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert line.startswith("vx: error: no sample could be read") and looks in line, line


def test_an_empty_input_and_a_missing_one_exit_2(tmp_path, tiny_model):
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    r = vx_cmd("extract", str(tmp_path / "empty.jsonl"), "-o", str(tmp_path / "out"), "--backend", "hf")
    assert r.returncode == 2 and "holds no records" in r.stderr, r.stderr
    r = vx_cmd("extract", str(tmp_path / "nope-*.parquet"), "-o", str(tmp_path / "out2"), "--backend", "hf")
    assert r.returncode == 2 and "matches no file" in r.stderr, r.stderr
