"""Partition workers as Ray tasks on an existing cluster (`--ray`, extract and regenerate).

A task runs the same partition worker as a local data-parallel run (`python -m vx.launch.worker JOB CONFIG`)
as a subprocess on its node, so vLLM runs in a plain process with the GPUs Ray gave the task
(CUDA_VISIBLE_DEVICES), and raises if that worker fails; its progress reaches the driver through
a small actor. Ray retries a failed task (`--max-retries`).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

from vx.errors import UsageError
from vx.launch.workers import GROUP_EXIT_S, Tally, last_line, log_tail, reap_worker, spawn_worker, stop_worker

# The driver's settings that workers on other nodes need: vx's, S3's and the hub's, and the engine's
# own (vLLM's runner, attention backend and timeouts; CUDA, NCCL, PyTorch and OpenMP settings), so
# every node runs the engine the driver's user configured. CUDA_VISIBLE_DEVICES is Ray's to assign.
FORWARD_ENV = ("VX_", "AWS_", "HF_", "VLLM_", "CUDA_", "NCCL_", "PYTORCH_", "TORCH_", "OMP_")
NODE_OWN_ENV = {"CUDA_VISIBLE_DEVICES"}


def forwarded_env(environ) -> dict:
    """The variables of the driver's environment a partition task carries to its node."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARD_ENV) and k not in NODE_OWN_ENV}


class ProgressSink:
    """A Ray actor the partition tasks report progress to; the driver polls it."""

    def __init__(self):
        self.seen: dict[str, tuple[int, dict]] = {}
        self.nodes: dict[str, str] = {}  # attempt -> its Ray node id, in the order attempts began

    def report(self, key: str, index: int, rec: dict, node_id: str = "") -> None:
        self.seen[key] = (index, rec)
        self.nodes.setdefault(key, node_id)

    def snapshot(self) -> dict[str, tuple[int, dict]]:
        return self.seen

    def attempt_nodes(self) -> dict[str, str]:
        return self.nodes


def plan_payload(plan_file) -> dict:
    """The partition plan and its rows' token counts, as bytes for Ray's object store."""
    from vx.launch.plan import tokens_file

    tokens = tokens_file(plan_file)
    return {"plan": Path(plan_file).read_bytes(), "tokens": tokens.read_bytes() if tokens.exists() else None}


def partition_task(config: dict, plan: dict, env: dict, sink, job: str) -> dict:
    """One attempt at one partition, on whatever node Ray chose (`python -m vx.launch.worker JOB CONFIG`)."""
    import ray

    index, attempt = config["partition_index"], uuid.uuid4().hex[:8]
    node_id = ray.get_runtime_context().get_node_id()
    got: dict = {}

    def relay(rec: dict) -> None:
        sink.report.remote(f"{index}-{attempt}", index, rec, node_id)
        if rec["vx"] == "summary":
            got["summary"] = rec["summary"]

    with tempfile.TemporaryDirectory(prefix="vx-ray-") as tmp:
        from vx.launch.plan import tokens_file

        plan_file = Path(tmp) / "plan.npy"
        plan_file.write_bytes(plan["plan"])
        if plan["tokens"] is not None:
            tokens_file(plan_file).write_bytes(plan["tokens"])
        log = Path(tmp) / "worker.log"
        proc, reader = spawn_worker(dict(config, plan_file=str(plan_file)), env, log, relay, job)
        try:
            while proc.poll() is None:  # not proc.wait(): ray.cancel's KeyboardInterrupt cannot end a blocking wait
                time.sleep(0.2)
        except BaseException:  # cancelled (run_tasks' stop_others): the worker ends as on Ctrl-C
            stop_worker(proc, reader)
            raise
        reap_worker(proc, reader)
        if proc.returncode != 0 or "summary" not in got:
            why = f"partition {index} worker exited {proc.returncode} on {ray.util.get_node_ip_address()}"
            # its log goes with this temp dir: its tail stays in Ray's log of this task's worker on
            # this node (logs/worker-*.err), for a driver that is gone or cut off from this node
            print(f"vx: {why}; its last lines:\n{log_tail(log)}", file=sys.stderr, flush=True)
            raise RuntimeError(f"{why}: {last_line(log)}")
    return dict(got["summary"], node=ray.util.get_node_ip_address(), node_id=node_id, attempt=attempt)


def require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("--ray needs Ray on every node: pip install 'vx[ray]'") from None


def connect(address: str | None) -> None:
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    hint = ("Start one with `ray start --head` (and `ray start --address HEAD:6379` on the other nodes), "
            "or give --ray-address")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if host and port.isdigit():  # Ray retries an unreachable address for minutes; probe it first
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise UsageError(f"no Ray cluster at {address!r} ({e.strerror or e}). {hint}") from None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError) as e:
        raise UsageError(f"no Ray cluster at {address!r} ({str(e).splitlines()[0][:160]}). {hint}") from None


def cluster_engines(tp: int) -> tuple[int, int]:
    """(GPUs of the cluster, engines of tp GPUs it holds; on a CPU cluster one per CPU)."""
    import ray

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    return gpus, max(1, gpus // tp if gpus else int(resources.get("CPU", 1)))


def cpus_per_node() -> int:
    import ray

    return max(int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n.get("Alive"))


def run_tasks(configs: list[dict], plan: dict, num_gpus: int, max_retries: int, tally: Tally,
              job: str, stop_others: str | None = None) -> tuple[dict[int, dict], dict[int, str], dict[int, list]]:
    """Each partition's worker config as a Ray task (retried up to max_retries times), progress
    folded into tally. Returns (summary of each finished partition, with its node and finish
    time; reason of each that failed; the Ray node id of each attempt of each, in order). A partition whose retries are spent
    leaves the others to finish, unless stop_others (why) is given: then the others are
    cancelled, their workers stopped as Ctrl-C stops a run (committed work kept)."""
    import ray

    plan_ref = ray.put(plan)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # on the driver's own node: a node lost mid-run takes its partitions' attempts, never the tally
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    sink = ray.remote(num_cpus=0)(ProgressSink).options(scheduling_strategy=here).remote()
    task = ray.remote(partition_task).options(num_gpus=num_gpus, num_cpus=1, max_retries=max_retries,
                                              retry_exceptions=True)
    env = forwarded_env(os.environ)
    refs = {task.remote(c, plan_ref, env, sink, job): c["partition_index"] for c in configs}
    results, failed = {}, {}
    t_start = time.perf_counter()
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
        for key, (index, rec) in ray.get(sink.snapshot.remote()).items():
            tally.update(key, rec)
        for ref in ready:
            index = refs.pop(ref)
            try:
                results[index] = dict(ray.get(ref), finished_s=round(time.perf_counter() - t_start, 2))
            except Exception as e:  # retries exhausted
                failed[index] = str(e).strip().splitlines()[-1][:300]
                if stop_others and refs:
                    _cancel_all(refs, results, failed, t_start, stop_others)
                    break
    attempts: dict[int, list[str]] = {}  # each partition's attempts: their nodes, in order
    seen, nodes = ray.get([sink.snapshot.remote(), sink.attempt_nodes.remote()])
    for key, (index, _) in seen.items():
        attempts.setdefault(index, []).append(nodes.get(key, ""))
    return results, failed, attempts




def _cancel_all(refs: dict, results: dict, failed: dict, t_start: float, why: str) -> None:
    """Cancel every task in refs (pending ones never start; a running one stops its worker, which
    ends as on Ctrl-C) and collect each: finished meanwhile, or stopped. A task that has not ended
    GROUP_EXIT_S after its worker should have is force-cancelled (its Ray worker killed; the
    partition worker dies with it)."""
    import ray

    for ref in refs:
        ray.cancel(ref)
    for ref, index in list(refs.items()):
        del refs[ref]
        try:
            results[index] = dict(ray.get(ref, timeout=2 * GROUP_EXIT_S), finished_s=round(time.perf_counter() - t_start, 2))
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            failed[index] = f"stopped: {why}"
        except ray.exceptions.TaskCancelledError:
            failed[index] = f"stopped: {why}"
        except Exception as e:
            failed[index] = str(e).strip().splitlines()[-1][:300]
