"""The real `vx` command, run as a subprocess (and its parser's mistakes in-process)."""

import json
import os
import subprocess
import sys

import pytest

import vx
from conftest import ROOT


def vx_cmd(*args, env=None, cwd=ROOT):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "vx", *args], capture_output=True, text=True, env=e, cwd=cwd,
                          timeout=900)


def test_extract_on_the_embedded_default_from_a_clean_cache(tmp_path):
    out = tmp_path / "out"
    r = vx_cmd("extract", "examples/chat.jsonl", "-o", str(out), "--backend", "hf", "--json",
               env={"VX_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["samples"] == 64 and summary["errors"] == 0
    assert (tmp_path / "cache" / "tiny-qwen3_5-v1" / "config.json").exists()
    ds = vx.open_dataset(out)
    assert len(ds) == 64
    item = ds["chat-000"]
    assert item["hidden_states"].shape == (len(item["input_ids"]), 5, 256)
    assert item["hidden_states"].float().abs().sum() > 0
    insp = vx_cmd("inspect", str(out), "--json")
    assert insp.returncode == 0 and json.loads(insp.stdout)["samples"] == 64
    # what lossless codecs would save on these very states: measured on the first 4 MB of them
    codecs = vx_cmd("inspect", str(out), "--codecs", "--codec-mb", "4", "--json")
    assert codecs.returncode == 0, codecs.stderr
    got = json.loads(codecs.stdout)
    assert got["measured_bytes"] == min(4_000_000, ds.num_tokens * 5 * 256 * 2)  # bf16 [T, 5, 256]
    names = [r["codec"] for r in got["codecs"]]
    assert names[:2] == ["zstd-1", "planes"] and all(r["lossless"] and r["ratio"] > 1 for r in got["codecs"])
    # rerunning the same command continues: nothing left to do, nothing duplicated
    again = vx_cmd("extract", "examples/chat.jsonl", "-o", str(out), "--backend", "hf", "--json",
                   env={"VX_CACHE_DIR": str(tmp_path / "cache")})
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["resumed_samples"] == 64 and len(vx.open_dataset(out)) == 64


def test_user_errors_exit_2_with_one_line_and_no_traceback(tmp_path, tiny_model):
    r = vx_cmd("extract", "examples/chat.jsonl", "-o", str(tmp_path / "o"), "--model", "Qwen/Qwen3-8B")
    assert r.returncode == 2
    assert "not a local directory" in r.stderr and "Traceback" not in r.stderr
    r = vx_cmd("extract", "examples/chat.jsonl", "-o", str(tmp_path / "o"), "--backend", "hf", "--layers", "0,99")
    assert r.returncode == 2 and "out of range" in r.stderr and "Traceback" not in r.stderr
    r = vx_cmd("extract", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "is not a file" in r.stderr


@pytest.mark.parametrize("flag, value, says", [("--top-p", "0", "--top-p must be in (0, 1]"),
                                               ("--temperature", "-1", "--temperature must be >= 0"),
                                               ("--max-tokens", "0", "--max-tokens must be >= 1"),
                                               ("--turns", "first", "--turns must be all or last"),
                                               ("--top-k", "-2", "--top-k must be >= 1")])
def test_a_bad_generation_option_is_one_line_from_both_commands_that_take_it(flag, value, says, capsys):
    """vx regenerate and vx extract --regenerate check their generation options the same way,
    before any file is read or engine started."""
    from vx.cli import main

    for argv in (["regenerate", "examples/chat.jsonl", flag, value],
                 ["extract", "examples/chat.jsonl", "--regenerate", flag, value]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)


@pytest.mark.parametrize("argv", [[], ["extract"], ["regenerate"], ["extract", "d.jsonl", "--bogus"], ["frobnicate"],
                                  ["extract", "d.jsonl", "--shard-size", "big"]])
def test_a_mistake_the_parser_catches_prints_help_or_a_usage_line_and_exits_2(argv, capsys):
    """On every typer the package allows (>= 0.17 vendors click as typer._click: its errors are
    other classes than click's)."""
    from vx.cli import main

    assert main(argv) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert "Usage" in out.out + out.err


def test_a_different_layer_set_against_the_same_output_is_refused(tmp_path, tiny_model):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    out = str(tmp_path / "o")
    assert vx_cmd("extract", str(data), "-o", out, "--backend", "hf", "--layers", "1,2").returncode == 0
    r = vx_cmd("extract", str(data), "-o", out, "--backend", "hf", "--layers", "1,3")
    assert r.returncode == 2 and "--overwrite" in r.stderr
    assert vx_cmd("extract", str(data), "-o", out, "--backend", "hf", "--layers", "1,3", "--overwrite").returncode == 0


def test_help_teaches():
    r = vx_cmd("extract", "--help")
    assert r.returncode == 0
    for flag in ("--layers", "--backend", "--max-length", "--overlong", "--strict", "--shard-size"):
        assert flag in r.stdout


def test_vllm_and_hf_backends_produce_the_same_samples_through_the_cli(tmp_path, tiny_model, chat_vllm_run):
    assert chat_vllm_run.result.returncode == 0, chat_vllm_run.result.stderr[-3000:]
    runs = {"vllm": (json.loads(chat_vllm_run.result.stdout), vx.open_dataset(chat_vllm_run.out))}
    out = tmp_path / "hf"
    r = vx_cmd("extract", "examples/chat.jsonl", "-o", str(out), "--backend", "hf", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    runs["hf"] = (json.loads(r.stdout), vx.open_dataset(out))
    (sv, v), (sh, h) = runs["vllm"], runs["hf"]
    assert sv["backend"] == "vllm" and sv["samples"] == sh["samples"] == 64 and sv["tokens"] == sh["tokens"]
    assert sorted(v.ids) == sorted(h.ids)
    for sid in h.ids:
        assert v[sid]["input_ids"].tolist() == h[sid]["input_ids"].tolist()
        assert v[sid]["loss_mask"].tolist() == h[sid]["loss_mask"].tolist()
        assert v[sid]["hidden_states"].shape == h[sid]["hidden_states"].shape


def test_verify_passes_on_a_good_output_and_catches_corruption_and_off_by_one(tmp_path, tiny_model):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " * (i + 3)}) + "\n" for i in range(6)))
    out = tmp_path / "o"
    assert vx_cmd("extract", str(data), "-o", str(out), "--backend", "hf", "--layers", "1,2,7").returncode == 0
    ok = vx_cmd("verify", str(out), "--samples", "3", "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] and report["samples_checked"] == 3 and all(l["min_cosine"] > 0.999 for l in report["layers"])
    # a layer off by one (what peers shipped) is caught
    meta = json.loads((out / "vx.json").read_text())
    (out / "vx.json").write_text(json.dumps(dict(meta, layer_ids=[2, 3, 7])))
    bad = vx_cmd("verify", str(out), "--samples", "2")
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout
    (out / "vx.json").write_text(json.dumps(meta))
    # a flipped byte in a shard is caught by the checksum
    shard = next(out.glob("shard-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF
    shard.write_bytes(bytes(raw))
    bad = vx_cmd("verify", str(out), "--samples", "0")
    assert bad.returncode == 1 and shard.name in bad.stdout
