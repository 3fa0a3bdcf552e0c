"""Seeing a long run: the live figures, Prometheus metrics, the watch over a whole output, its plot.

All against real processes and real HTTP: a `--data-parallel-size 2` extraction to an S3
endpoint (moto's server on loopback; the HF backend, whose workers start in seconds: the figures
are the same code on both backends, and the vLLM path's own record is checked by test_first_run)
is scraped over HTTP while it runs, watched by `vx inspect
--watch` in another process, one of its partitions is killed mid-run (seen as stalled), and the
rerun ends the watch. The MFU numerator is held against the model's own parameter count.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import ROOT, write_jsonl
from test_s3 import CREDS, start_s3


def metric_values(text: str, name: str) -> dict[str, float]:
    """partition label -> value of one metric in a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            part = dict(kv.split("=", 1) for kv in labels.split(","))["partition"].strip('"')
            out[part] = float(value)
    return out


@pytest.fixture(scope="module")
def s3():
    from s3_faults import free_port

    server, url, client = start_s3(free_port())
    yield url, client
    server.stop()


def test_a_data_parallel_run_to_s3_is_scraped_watched_and_plotted_while_it_runs(s3, tmp_path, tiny_model):
    from s3_faults import free_port

    url, _ = s3
    rows = [json.loads(line) for line in (ROOT / "examples/chat.jsonl").read_text().splitlines() if line]
    data = write_jsonl(tmp_path / "d.jsonl", [dict(r, id=f"{r['id']}-{k}") for k in range(5) for r in rows])
    port = free_port()
    env = dict(os.environ, **CREDS, VX_PROGRESS_RECORD_EVERY="1")
    run = [sys.executable, "-m", "vx", "extract", str(data), "-o", "s3://vx-out/watched", "--endpoint-url", url,
           "--backend", "hf", "--dp", "2", "--shard-size", "4", "--metrics-port", str(port),
           "--progress-every", "1", "--json"]
    t0 = time.monotonic()
    first = subprocess.Popen(run, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = subprocess.Popen([sys.executable, "-m", "vx", "inspect", "s3://vx-out/watched", "--endpoint-url", url,
                              "--watch", "--json", "--interval", "1", "--stall-after", "6"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    polls: list[dict] = []
    threading.Thread(target=lambda: [polls.append(json.loads(line)) for line in watch.stdout], daemon=True).start()
    try:
        # scrape while it runs; kill partition 1's worker once it has committed samples
        scrapes, killed = [], None
        deadline = time.monotonic() + 900  # engines start on a loaded machine: wait for events
        while first.poll() is None and time.monotonic() < deadline:
            try:
                scrapes.append(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
            except OSError:
                pass  # not listening yet
            rows1 = [r for p in polls[-1:] for r in p["rows"] if r["partition"].startswith("part-00001")]
            if killed is None and rows1 and rows1[0]["state"] == "running" and rows1[0]["samples"] >= 10:
                killed, t_kill = rows1[0]["pid"], time.monotonic()
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.5)
        out, err = first.communicate(timeout=60)
        print(f"first run {time.monotonic() - t0:.1f}s, killed at {t_kill - t0:.1f}s")
        assert killed, f"partition 1 was never seen running; last poll {polls[-1:]}, stderr {err[-2000:]}"
        assert first.returncode == 1 and "partition 1" in err.strip().splitlines()[-1], err[-2000:]

        # metrics over HTTP while it ran: counters rose, one label per partition, MFU a fraction
        samples = [metric_values(t, "vx_samples_total") for t in scrapes]
        assert any({"0", "1"} <= set(s) for s in samples), scrapes[-1][:3000]
        p0 = [s["0"] for s in samples if "0" in s]
        assert len(set(p0)) >= 2 and p0 == sorted(p0), p0  # rising, never falling
        mfu = [v for t in scrapes for v in metric_values(t, "vx_mfu").values() if v > 0]
        assert mfu and all(0 < v < 1 for v in mfu), mfu
        assert any(metric_values(t, "vx_bytes_uploaded_total") for t in scrapes)
        assert any(metric_values(t, "vx_device_memory_bytes") for t in scrapes)
        # the live line in a log (stderr not a terminal): figures and each partition's rate
        lines = [x for x in err.splitlines() if x.startswith("extract: ")]
        assert any("MFU" in x and "| ppart" not in x and "| p" in x for x in lines), err[-2000:]

        # the watch from another process: both partitions progressing, then the killed one stalled
        assert any(all(r["state"] == "running" and r["samples"] > 0 for r in p["rows"]) and len(p["rows"]) == 2
                   for p in polls), polls[-3:]
        t = time.monotonic()
        while not any(any(f.startswith("part-00001-of-00002: stalled") for f in p["flags"]) for p in polls):
            assert watch.poll() is None and time.monotonic() - t < 120, polls[-3:]
            time.sleep(0.5)
        assert not polls[-1]["ended"]

        # the rerun finishes the killed partition: the watch sees the end and exits by itself
        t1 = time.monotonic()
        again = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        print(f"rerun {time.monotonic() - t1:.1f}s")
        assert again.returncode == 0, again.stderr[-3000:]
        summary = json.loads(again.stdout)
        assert summary["samples"] + summary["resumed_samples"] == 5 * len(rows) and 0 < summary["mfu"] < 1
        assert watch.wait(timeout=120) == 0
        last = polls[-1]
        assert last["ended"] and last["samples"] > 0 and all(r["state"] == "done" for r in last["rows"])
    finally:
        for p in (first, watch):
            if p.poll() is None:
                p.kill()

    # the history, drawn: a PNG with a line per partition
    png = tmp_path / "run.png"
    r = subprocess.run([sys.executable, "-m", "vx", "inspect", "s3://vx-out/watched", "--endpoint-url", url,
                        "--plot", str(png), "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["writers"] == 2
    from PIL import Image

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as im:
        im.verify()


def test_mfu_counts_two_flops_per_weight_of_the_layers_up_to_the_last_captured_one(tiny_model, fp32_model):
    """Against the model's own parameters (torch), not the checkpoint's headers vx reads."""
    from vx.monitor.flops import flops_per_token

    def params(upto):
        return sum(p.numel() for n, p in fp32_model.named_parameters()
                   if ".layers." in n and int(n.split(".layers.")[1].split(".")[0]) <= upto)

    assert flops_per_token(tiny_model, 3) == 2 * params(3)
    assert flops_per_token(tiny_model) == 2 * params(10 ** 6)
    assert flops_per_token(tiny_model, 3) < flops_per_token(tiny_model, 5)
