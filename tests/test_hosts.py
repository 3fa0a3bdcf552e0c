"""Faults between real hosts: `vx extract --ray` over a cluster of hosts on one machine (network
namespaces on a bridge, tests/hosts.py): the Ray head on host a (where the driver runs), a worker
node with its own raylet on host b, moto's S3 server on host s3. Each host has its own address,
hostname, temp directory and vx staging directory; they share only the filesystem (the model and
the data, as an NFS mount would). Ray is told to declare a node dead after ~3 s of missed health
checks, and its gRPC calls to fail after ~3 s of unanswered keepalive pings (FAST_DEATH).

- Node loss: every process of host b killed while its partition is mid-run. Ray retries the
  partition on a; the retry takes the prefix over and sweeps what the dead attempt left.
- Partition and heal: hosts a and b cut from each other (each one's route to the other refused)
  while b's partition worker is paused before an upload, for longer than Ray's node timeout; b still
  reaches S3, as a node cut off from its cluster but not from the object store does. Ray retries
  the partition on a, which finishes the run; then b's worker wakes beside its finished retry,
  still cut off from Ray (so its raylet has not yet been told it is dead and killed it), and stops
  at its next S3 step with the one line naming the owner (host a), writing nothing. Then the
  routes come back: b's raylet learns it was declared dead and exits, and b rejoins as a new node.
- S3 cut off from one host: host b cannot reach S3 while a can. b's attempt fails in one line,
  the run says which partition failed, and a rerun finishes it.

After each: every sample exactly once, every listed shard's size and CRC64-NVME, every row within
cosine 0.999 of a clean run, no unlisted shard and no open multipart upload (tests/fault_checks.py's
own reading of the objects), and `vx verify`. The hf backend keeps the engines cheap: none of these
faults is about the engine. The partition case also runs on vLLM (VX_HOSTS_VLLM=1, ~2.5 min: three
engine starts on one-CPU hosts), whose batching gives the two attempts other bytes under the same
shard numbers; so does the two-writer case without hosts, the fault campaign's `two-writers-vllm`
mode (`python tests/fault_campaign.py`)."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import fault_checks as checks
import hosts
from conftest import ROOT, machine_cache
from test_s3 import CREDS
from test_two_writers import chats

pytestmark = pytest.mark.skipif(hosts.available() is not None, reason=f"hosts as namespaces: {hosts.available()}")

ROWS = 24
RAY = str(Path(sys.executable).with_name("ray"))
FAST_DEATH = {"RAY_AUTH_MODE": "disabled", "RAY_health_check_initial_delay_ms": "1000",
              "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
              "RAY_health_check_failure_threshold": "3",
              "RAY_gcs_rpc_server_reconnect_timeout_s": "600",  # a raylet cut off waits for the heal
              # the driver's call to a task on a cut-off node fails once its keepalive pings go
              # unanswered (Ray's default: 5 min, then 2 min), and only then is the task retried
              "RAY_grpc_client_keepalive_time_ms": "1000", "RAY_grpc_client_keepalive_timeout_ms": "2000"}


class Cluster:
    def __init__(self, root: Path):
        self.net = hosts.Net(root, ["s3", "a", "b"])
        self.s3, self.a, self.b = self.net["s3"], self.net["a"], self.net["b"]
        for h in (self.a, self.b):
            machine_cache(h.root / "cache" / "vx")
        self.url = f"http://{self.s3.addr}:5000"
        self.moto = self.s3.popen([sys.executable, "-m", "moto.server", "-H", self.s3.addr, "-p", "5000"],
                                  stdout=open(root / "moto.log", "w"), stderr=open(root / "moto.err", "w"))
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                                   aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
                                   aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"])
        wait_for(lambda: _ok(lambda: self.client.create_bucket(Bucket="vx-out")), "moto on host s3", 60)
        self.ray(self.a, "--head", "--port", "6379", "--include-dashboard", "false")
        self.ray(self.b, "--address", f"{self.a.addr}:6379")

    def ray(self, host, *args) -> None:
        r = host.run([RAY, "start", *args, "--node-ip-address", host.addr, "--num-cpus", "1",
                      "--object-store-memory", str(128 << 20), "--temp-dir", str(host.tmp / "ray"),
                      "--disable-usage-stats"], env=FAST_DEATH, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]

    def nodes_alive(self) -> int:
        r = self.a.run([sys.executable, "-c", "import ray; ray.init(address='auto', logging_level='ERROR'); "
                        "print(sum(n['Alive'] for n in ray.nodes()))"], env=dict(FAST_DEATH, RAY_ADDRESS=f"{self.a.addr}:6379"))
        return int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else 0

    def revive_b(self) -> None:
        """Host b back as a fresh node (its raylet killed with it, or told by the head it was dead)."""
        self.b.kill()
        wait_for(lambda: not self.b.pids(), "host b's processes to end", 30)
        self.ray(self.b, "--address", f"{self.a.addr}:6379")
        wait_for(lambda: self.nodes_alive() == 2, "two live Ray nodes", 60)

    def extract(self, data, prefix: str, *extra, env=None, wait=True):
        if "--backend" not in extra:
            extra = ("--backend", "hf", *extra)
        cmd = [sys.executable, "-m", "vx", "extract", str(data), "-o", f"s3://vx-out/{prefix}", "--endpoint-url",
               self.url, "--model", str(self.model), "--batch-size", "4", "--shard-size", "0.3",
               "--ray", "--ray-address", f"{self.a.addr}:6379", "--num-partitions", "2", "--json",
               "--progress-every", "1000", *extra]
        e = dict(CREDS, **FAST_DEATH, OMP_NUM_THREADS="1", **(env or {}))
        if wait:
            return self.a.run(cmd, env=e, cwd=ROOT, timeout=600)
        return self.a.popen(cmd, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def close(self) -> None:  # each host's processes, by its namespace (`ray stop` would stop every Ray here)
        self.moto.kill()
        self.net.close()


def _ok(call) -> bool:
    try:
        call()
        return True
    except Exception:
        return False


def wait_for(pred, what: str, timeout: float = 300, state=None):
    """state(): what to show beside the timeout (the processes and logs that explain it)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f"\n{state()}" if state else ""))
        time.sleep(0.3)


def b_state(cl: Cluster, tmp: Path) -> str:
    """Host b's processes, the failpoint's trace, and the tails of b's Ray worker and raylet logs."""
    ps = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-p", ",".join(map(str, cl.b.pids())) or "1"],
                        capture_output=True, text=True).stdout
    trace = (tmp / "trace").read_text() if (tmp / "trace").exists() else "(no trace)"
    logs = [f"{p.name}:\n{p.read_text(errors='replace')[-1500:]}"
            for p in sorted(cl.b.tmp.glob("ray/session_*/logs/*.err")) + sorted(cl.b.tmp.glob("ray/session_*/logs/raylet.out"))]
    return "\n".join([f"b's processes:\n{ps[-3000:]}", f"trace: {trace}", *logs])


@pytest.fixture(scope="module")
def cluster(tiny_model):
    root = Path(tempfile.mkdtemp(prefix="vxh", dir="/tmp"))  # short: Ray's sockets live under it
    cl = Cluster(root)
    cl.model = tiny_model
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats(ROWS)))
    ref = cl.a.run([sys.executable, "-m", "vx", "extract", str(data), "-o", str(root / "ref"), "--model", str(tiny_model),
                    "--backend", "hf", "--batch-size", "4", "--json"], cwd=ROOT)
    assert ref.returncode == 0, ref.stderr[-2000:]
    files = checks.Output.local(root / "ref")
    _, headers = checks.checksums_pass(files)
    cl.data, cl.reference = data, {k: v for n, h in headers.items() for k, v in checks.rows_of(files.files[n], h).items()}
    try:
        yield cl
    finally:
        cl.close()


def assert_whole(cl: Cluster, prefix: str, min_cos: float = 0.999) -> None:
    files = checks.Output.s3(cl.client, "vx-out", prefix)
    bad = checks.exactly_once(files, [r["id"] for r in chats(ROWS)])
    sums, headers = checks.checksums_pass(files)
    bad += sums + checks.states_match(files, headers, cl.reference, min_cos)  # the reference: a clean hf run
    bad += checks.s3_listing_agrees(files, cl.client, "vx-out", prefix)
    assert not bad, bad
    verify = cl.a.run([sys.executable, "-m", "vx", "verify", f"s3://vx-out/{prefix}", "--endpoint-url", cl.url],
                      env=CREDS, cwd=ROOT)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def paused_on_b(tmp: Path, until: Path | None = None) -> dict:
    """The failpoint that pauses the partition worker on host b before its third shard upload (two
    shards in S3 already); the retry on host a runs clean."""
    env = {"VX_FAULT": "before-upload:3:stall", "VX_FAULT_HOST": "b", "VX_FAULT_STALL_S": "600",
           "VX_FAULT_TRACE": str(tmp / "trace")}
    if until is not None:
        env["VX_FAULT_STALL_UNTIL"] = str(until)
    return env


def fired(tmp: Path) -> bool:
    trace = tmp / "trace"
    return trace.exists() and "fired before-upload" in trace.read_text()


def summary_of(r) -> dict:
    return json.loads(r.stdout if isinstance(r.stdout, str) else r.stdout.read())


def test_node_loss_mid_partition_is_retried_on_the_other_host_and_the_output_is_whole(cluster, tmp_path):
    cl = cluster
    driver = cl.extract(cl.data, "loss", env=paused_on_b(tmp_path), wait=False)
    try:
        wait_for(lambda: fired(tmp_path) or driver.poll() is not None, "host b's partition to pause mid-run")
        assert driver.poll() is None, driver.communicate()[1][-2000:]
        assert cl.b.kill() > 0  # the raylet, its workers, the partition worker: the whole node
        out, err = driver.communicate(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
        cl.revive_b()
    assert driver.returncode == 0, err[-3000:]
    s = json.loads(out)
    assert sorted(p["attempts"] for p in s["partitions"]) == [1, 2], s["partitions"]
    assert s["samples"] == ROWS
    assert_whole(cl, "loss")


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.skipif(
    not os.environ.get("VX_HOSTS_VLLM"), reason="three vLLM engine starts on one-CPU hosts (~2.5 min): "
    "VX_HOSTS_VLLM=1 runs it"))])
def test_a_partitioned_host_healed_after_its_retry_finished_stops_at_its_next_s3_step(cluster, tmp_path, backend):
    """With vLLM too: its batching gives the two attempts' shards other bytes under the same
    numbers, which is what exposed the unfenced writer."""
    cl = cluster
    wake = tmp_path / "wake"
    prefix = f"heal-{backend}"
    driver = cl.extract(cl.data, prefix, "--backend", backend, env=paused_on_b(tmp_path, wake), wait=False)
    try:
        wait_for(lambda: fired(tmp_path) or driver.poll() is not None, "host b's partition to pause mid-run")
        assert driver.poll() is None, driver.communicate()[1][-2000:]
        cl.a.cut(cl.b.addr)  # the partition: b's worker keeps running, cut off from Ray, not from S3
        cl.b.cut(cl.a.addr)
        out, err = driver.communicate(timeout=400)
        assert driver.returncode == 0, err[-3000:]
        s = json.loads(out)
        retried = [p for p in s["partitions"] if p["attempts"] == 2]
        assert len(retried) == 1 and s["samples"] == ROWS, s["partitions"]
        part = f"part-{retried[0]['partition']:05d}-of-00002"
        owner = json.loads(cl.client.get_object(Bucket="vx-out", Key=f"{prefix}/{part}/.vx-owner.json")["Body"].read())
        assert owner["host"] == "a", owner
        wake.touch()  # b's worker wakes beside the finished retry, before the heal
        said = f"s3://vx-out/{prefix}/{part} was taken over by another writer"  # b's worker's line, not an earlier test's
        logs = lambda: [p.read_text(errors="replace") for p in cl.b.tmp.glob("ray/session_*/logs/worker-*.err")]  # noqa: E731
        wait_for(lambda: any(said in t for t in logs()), "the woken worker's line", 120, lambda: b_state(cl, tmp_path))
    finally:
        if driver.poll() is None:
            driver.kill()
        cl.a.uncut(cl.b.addr)  # the heal: b's raylet is told it was declared dead
        cl.b.uncut(cl.a.addr)
        cl.revive_b()
    line = next(ln for t in logs() for ln in t.splitlines() if said in ln).strip()
    assert line.startswith("vx: ") and f"s3://vx-out/{prefix}/{part}" in line, line
    assert f"pid {owner['pid']} on a" in line and f"attempt {owner['attempt']}" in line and " on b)" in line, line
    assert_whole(cl, prefix, 0.999 if backend == "hf" else 0.99)


def test_s3_cut_off_from_one_host_fails_its_partition_in_one_line_and_a_rerun_finishes(cluster, tmp_path):
    cl = cluster
    cl.b.cut(cl.s3.addr)
    try:
        r = cl.extract(cl.data, "cut", "--max-retries", "0")
    finally:
        cl.b.uncut(cl.s3.addr)
    print(f"with S3 cut off from host b: exit {r.returncode}, {r.stderr.strip().splitlines()[-1][:400]}")
    if r.returncode:  # b's attempt could not reach S3 (a task on a would have)
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("vx: ") and "partitions failed" in last and "cannot reach the S3 endpoint" in last \
            and "Traceback" not in r.stderr[-3000:], r.stderr[-3000:]
        again = cl.extract(cl.data, "cut")
        assert again.returncode == 0, again.stderr[-3000:]
    assert_whole(cl, "cut")
