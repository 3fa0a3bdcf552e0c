"""The S3 sink against a real S3 endpoint over HTTP (moto's server on loopback, started here)."""

import json

import boto3
import pytest

import vx
from conftest import machine_cache, write_jsonl
from test_cli import vx_cmd

CREDS = {"AWS_ACCESS_KEY_ID": "vx-test", "AWS_SECRET_ACCESS_KEY": "vx-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def start_s3(port: int, create_bucket: bool = True):
    """moto's S3 server on 127.0.0.1:port (its store outlives a stop/start in this process)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="vx-test",
                          aws_secret_access_key="vx-test-secret")
    if create_bucket:
        client.create_bucket(Bucket="vx-out")
    return server, url, client


def start_s3_process(port: int):
    """moto's S3 server in its own process (its own store), with the bucket vx-out."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="vx-test",
                          aws_secret_access_key="vx-test-secret")
    deadline = time.time() + 60
    while True:
        try:
            client.create_bucket(Bucket="vx-out")
            return proc, url, client
        except Exception:
            if time.time() > deadline:
                proc.kill()
                raise
            time.sleep(0.3)


@pytest.fixture(scope="module")
def s3_server():
    from s3_faults import free_port

    server, url, client = start_s3(free_port())
    yield url, client
    server.stop()


def download(client, bucket, prefix, dest):
    dest.mkdir(parents=True, exist_ok=True)
    names = []
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        name = obj["Key"][len(prefix) + 1:]
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, obj["Key"], str(dest / name))
        names.append(name)
    return sorted(names)


def data_file(tmp_path, n=24):
    rows = [{"id": f"s{i}", "text": f"sample number {i} " * (5 + 7 * (i % 9))} for i in range(n)]
    rows.append({"id": "bad", "messages": []})
    return write_jsonl(tmp_path / "d.jsonl", rows)


def test_output_to_s3_holds_a_readable_dataset_and_local_disk_stays_bounded(s3_server, tmp_path, tiny_model):
    url, client = s3_server
    data = data_file(tmp_path)
    r = vx_cmd("extract", str(data), "-o", "s3://vx-out/run1", "--endpoint-url", url, "--backend", "hf",
               "--shard-size", "0.2", "--max-local-gb", "0.0005", "--batch-size", "4", "--json",
               env=dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "cache")))
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert s["samples"] == 24 and s["errors"] == 1 and s["shards"] > 3
    assert s["uploaded_bytes"] == s["bytes_written"]
    names = download(client, "vx-out", "run1", tmp_path / "copy")
    largest_shard = max(json.loads(line)["bytes"] for line in open(tmp_path / "copy" / "manifest.jsonl"))
    assert s["peak_local_bytes"] <= 0.0005e9 + largest_shard  # the bound plus one shard
    assert {"manifest.jsonl", "errors.jsonl", "vx.json"} <= set(names)
    ds = vx.open_dataset(tmp_path / "copy")  # a plain copy of the prefix opens as a dataset
    assert sorted(ds.ids) == sorted(f"s{i}" for i in range(24))
    assert ds["s3"]["hidden_states"].shape[0] == len(ds["s3"]["input_ids"])
    [staged] = (tmp_path / "cache" / "staging").glob("*/vx-out/run1")
    assert not list(staged.glob("shard-*.safetensors"))  # uploaded, verified, deleted locally
    assert "vx-test-secret" not in r.stdout + r.stderr
    # vx verify reads the S3 prefix directly: checksums in place, a few samples recomputed
    v = vx_cmd("verify", "s3://vx-out/run1", "--endpoint-url", url, "--samples", "3", "--json", env=CREDS)
    assert v.returncode == 0, v.stderr[-2000:]
    report = json.loads(v.stdout)
    assert report["ok"] and report["shards_checked"] == s["shards"] and report["samples_checked"] == 3
    shards = sorted(n for n in names if n.startswith("shard-"))
    client.put_object(Bucket="vx-out", Key="run1/" + shards[0], Body=b"corrupted")  # replaced behind vx's back
    flipped = bytearray((tmp_path / "copy" / shards[1]).read_bytes())
    flipped[len(flipped) // 2] ^= 1  # one bit of one state, same size
    client.put_object(Bucket="vx-out", Key="run1/" + shards[1], Body=bytes(flipped))
    from s3_faults import FaultyProxy

    with FaultyProxy(int(url.rsplit(":", 1)[1])) as proxy:  # against the checksum S3 computed on receipt
        bad = vx_cmd("verify", "s3://vx-out/run1", "--endpoint-url", proxy.url, "--samples", "0", env=CREDS)
    assert bad.returncode == 1 and "2 bad" in bad.stdout, bad.stdout + bad.stderr[-2000:]
    assert not [p for m, p in proxy.seen if m == "GET" and "shard-" in p], proxy.seen
    assert len([p for m, p in proxy.seen if m == "HEAD" and "shard-" in p]) == s["shards"]


def test_rerun_on_a_fresh_machine_resumes_from_the_s3_manifest(s3_server, tmp_path, tiny_model):
    url, client = s3_server
    data = data_file(tmp_path)
    args = ["extract", str(data), "-o", "s3://vx-out/run2", "--endpoint-url", url, "--backend", "hf", "--json"]
    first = vx_cmd(*args, env=dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "machine-a")))
    assert first.returncode == 0, first.stderr[-2000:]
    again = vx_cmd(*args, env=dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "machine-b")))
    assert again.returncode == 0, again.stderr[-2000:]
    s = json.loads(again.stdout)
    assert s["resumed_samples"] == 24 and s["samples"] == 0
    download(client, "vx-out", "run2", tmp_path / "copy")
    assert len(vx.open_dataset(tmp_path / "copy")) == 24


@pytest.mark.parametrize("target, endpoint, message", [
    ("s3://no-such-bucket/x", None, "does not exist"),
    ("s3://vx-out/x", "http://127.0.0.1:9", "cannot reach"),
])
def test_a_bad_target_fails_before_any_compute(s3_server, tmp_path, tiny_model, target, endpoint, message):
    url, _ = s3_server
    out = tmp_path / "local"
    r = vx_cmd("extract", str(data_file(tmp_path)), "-o", str(out), "--upload", target, "--endpoint-url",
               endpoint or url, "--backend", "hf", env=CREDS)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()  # nothing computed, nothing written
    assert "vx-test-secret" not in r.stderr


def test_throttling_and_5xx_are_retried_with_backoff(s3_server, tmp_path, tiny_model):
    from s3_faults import FaultyProxy

    url, client = s3_server
    with FaultyProxy(int(url.rsplit(":", 1)[1]), fail_every=4) as proxy:
        r = vx_cmd("extract", str(data_file(tmp_path)), "-o", "s3://vx-out/throttled", "--endpoint-url", proxy.url,
                   "--backend", "hf", "--shard-size", "0.2", "--json",
                   env=dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "cache")))
        assert r.returncode == 0, r.stderr[-2000:]
        assert proxy.injected >= 10  # one request in four answered 503 SlowDown
    download(client, "vx-out", "throttled", tmp_path / "copy")
    assert sorted(vx.open_dataset(tmp_path / "copy").ids) == sorted(f"s{i}" for i in range(24))


def test_bad_credentials_fail_before_any_compute(s3_server, tmp_path, tiny_model):
    from s3_faults import FaultyProxy

    url, _ = s3_server
    out = tmp_path / "local"
    with FaultyProxy(int(url.rsplit(":", 1)[1]), bad_key="AKIABADKEY") as proxy:
        r = vx_cmd("extract", str(data_file(tmp_path)), "-o", str(out), "--upload", "s3://vx-out/x",
                   "--endpoint-url", proxy.url, "--backend", "hf",
                   env=dict(CREDS, AWS_ACCESS_KEY_ID="AKIABADKEY", AWS_SECRET_ACCESS_KEY="do-not-print-me"))
    assert r.returncode == 2 and "access denied" in r.stderr and "Traceback" not in r.stderr
    assert "do-not-print-me" not in r.stderr + r.stdout and not out.exists()


def test_the_run_survives_an_s3_outage(tmp_path, tiny_model):
    import os
    import subprocess
    import sys
    import time

    from s3_faults import FaultyProxy, free_port

    port = free_port()
    server, url, client = start_s3(port)
    proxy = FaultyProxy(port).__enter__()  # counts the requests that find the server down
    env = dict(os.environ, **CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "vx", "extract", str(data_file(tmp_path, n=60)), "-o",
                             "s3://vx-out/outage", "--endpoint-url", proxy.url, "--backend", "hf", "--shard-size",
                             "0.2", "--batch-size", "2", "--max-local-gb", "0.01", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not client.list_objects_v2(Bucket="vx-out", Prefix="outage/shard-").get("KeyCount"):
            time.sleep(0.2)
        assert proc.poll() is None, "run finished before the outage could start"
        server.stop()  # the endpoint goes away mid-run ...
        deadline = time.time() + 30
        while time.time() < deadline and not proxy.unreachable:
            time.sleep(0.1)
        time.sleep(3)
        assert proxy.unreachable > 0 and proc.poll() is None  # the run's requests did meet the outage
        server, _, _ = start_s3(port, create_bucket=False)  # ... and comes back (same store)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        s = json.loads(out)
        assert s["uploaded_bytes"] == s["bytes_written"]
        largest = max(json.loads(line)["bytes"] for line in
                      client.get_object(Bucket="vx-out", Key="outage/manifest.jsonl")["Body"].read().decode().splitlines())
        assert s["peak_local_bytes"] <= 0.01e9 + largest
        download(client, "vx-out", "outage", tmp_path / "copy")
        assert sorted(vx.open_dataset(tmp_path / "copy").ids) == sorted(f"s{i}" for i in range(60))
    finally:
        if proc.poll() is None:
            proc.kill()
        proxy.__exit__(None, None, None)
        server.stop()


def test_another_layer_set_against_the_same_prefix_is_refused_unless_overwrite(s3_server, tmp_path, tiny_model):
    url, client = s3_server
    data = data_file(tmp_path)

    def run(layers, *extra, machine):
        return vx_cmd("extract", str(data), "-o", "s3://vx-out/run4", "--endpoint-url", url, "--backend", "hf",
                      "--layers", layers, *extra, env=dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / machine)))

    assert run("1,2", machine="a").returncode == 0
    refused = run("1,3", machine="b")  # a fresh machine: the identity comes from S3
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    assert run("1,3", "--overwrite", machine="b").returncode == 0
    download(client, "vx-out", "run4", tmp_path / "copy")
    ds = vx.open_dataset(tmp_path / "copy")
    assert ds.layer_ids == [1, 3] and sorted(ds.ids) == sorted(f"s{i}" for i in range(24))


def test_an_emptied_prefix_or_another_endpoint_starts_fresh_instead_of_failing(s3_server, tmp_path, tiny_model):
    from s3_faults import free_port

    url, client = s3_server
    data = data_file(tmp_path)
    env = dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "cache"))

    def run(endpoint):
        return vx_cmd("extract", str(data), "-o", "s3://vx-out/stale", "--endpoint-url", endpoint, "--backend", "hf",
                      "--json", env=env)

    assert run(url).returncode == 0
    for obj in client.list_objects_v2(Bucket="vx-out", Prefix="stale/")["Contents"]:  # someone empties the prefix
        client.delete_object(Bucket="vx-out", Key=obj["Key"])
    again = run(url)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "holds no extraction; discarding the stale local staging" in again.stderr
    assert json.loads(again.stdout)["samples"] == 24
    download(client, "vx-out", "stale", tmp_path / "copy")
    assert sorted(vx.open_dataset(tmp_path / "copy").ids) == sorted(f"s{i}" for i in range(24))
    # the same bucket name at another endpoint: another store (a second moto server process; the
    # servers of this process share one), another output
    other, other_url, other_client = start_s3_process(free_port())
    try:
        elsewhere = run(other_url)
        assert elsewhere.returncode == 0, elsewhere.stderr[-2000:]
        assert json.loads(elsewhere.stdout)["samples"] == 24 and "discarding" not in elsewhere.stderr
        download(other_client, "vx-out", "stale", tmp_path / "copy2")
        assert len(vx.open_dataset(tmp_path / "copy2")) == 24
        first = run(url)  # the first endpoint's output is intact
        assert first.returncode == 0 and json.loads(first.stdout)["resumed_samples"] == 24
    finally:
        other.kill()
        other.wait()


def test_committed_shards_lost_from_a_prefix_are_redone_with_a_notice(s3_server, tmp_path, tiny_model):
    url, client = s3_server
    data = data_file(tmp_path)
    env = dict(CREDS, VX_CACHE_DIR=machine_cache(tmp_path / "cache"))
    args = ["extract", str(data), "-o", "s3://vx-out/lost", "--endpoint-url", url, "--backend", "hf",
            "--shard-size", "0.2", "--json"]
    first = vx_cmd(*args, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    body = client.get_object(Bucket="vx-out", Key="lost/manifest.jsonl")["Body"].read().decode().splitlines()
    gone = json.loads(body[0])  # its object and its manifest line disappear from S3
    client.delete_object(Bucket="vx-out", Key=f"lost/{gone['shard']}")
    client.put_object(Bucket="vx-out", Key="lost/manifest.jsonl", Body="".join(x + "\n" for x in body[1:]).encode())
    again = vx_cmd(*args, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "1 committed shards are neither staged nor in s3://vx-out/lost" in again.stderr
    assert json.loads(again.stdout)["samples"] == len(gone["sample_ids"])
    download(client, "vx-out", "lost", tmp_path / "copy")
    ds = vx.open_dataset(tmp_path / "copy")
    assert sorted(ds.ids) == sorted(f"s{i}" for i in range(24)) and len(ds.ids) == 24


def test_verify_of_a_prefix_holding_no_extraction_is_one_clear_line(s3_server):
    url, client = s3_server
    client.put_object(Bucket="vx-out", Key="not-vx/readme.txt", Body=b"hello")
    r = vx_cmd("verify", "s3://vx-out/not-vx", "--endpoint-url", url, env=CREDS)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "s3://vx-out/not-vx has no vx.json and manifest.jsonl; is it a vx output?" in r.stderr
