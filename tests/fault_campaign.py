"""Fault campaign: crash vx wherever it makes data durable, rerun it, and check that nothing was
lost, doubled, torn or left behind.

    python tests/fault_campaign.py --trials 200 --seed 1 [--jobs 2] [--modes extract-hf,extract-vllm,...]
    python tests/fault_campaign.py --seed 1 --only 17      # trial 17 of campaign 1 again, alone

Each trial draws, from its own seed (campaign seed and trial number): a mode (`vx extract` on the
hf or vllm backend, local or to S3 over HTTP (moto's server on loopback; some trials with shards
over 5 MiB sent as multipart uploads of 5 MiB parts), --data-parallel-size 1 or 2, with a follow
reader (vx.loader(follow=True)) in some trials and --retain-gb in some of those; `vx regenerate`;
the one-pass mode `vx extract --regenerate`, local or to S3, --data-parallel-size 1 or 2; two writers of one
S3 output, hf or vLLM, --data-parallel-size 1 or 2: a first attempt paused at one of its uploader's
failpoints, a second attempt from another staging directory (another host) run to its end beside it,
the first woken then, which must stop with exit code 4 and one line); then a fault: one of vx.faults.POINTS that the mode
passes, at its n-th pass, acting by kill (SIGKILL of itself), eio, enospc or stall; or a signal
from outside (SIGKILL, SIGTERM or SIGINT to the driver, to its whole process group, to the vLLM
engine core, to one partition worker) at a random moment. Some trials fault the first rerun too
(a crash during recovery; repair-manifest is reached only there). Then the same command runs to
its end and tests/fault_checks.py checks: every sample committed exactly once; every committed
shard's size and CRC64-NVME (computed here); every stored row within cosine 0.99 of a clean run's,
its input ids equal; S3's listing equals the manifests' undropped shards, no multipart upload left
open, staging empty; no temp files; no process of a run (found by a mark in its environment)
outlives its driver by 30 s; every faulted run ends by itself (a stall included) with no
traceback, a signalled one within 60 s of the signal (a signalled partition worker within 60 s,
its launcher once the other partitions are done, as documented); the follow reader saw every sample once;
regenerated conversations once each; in the one-pass mode each stored conversation's ids are
those of its regenerated text (the tokenizer's own chat template), and in S3 one text segment is left.

The tally (trials, faults fired, failpoints reached, invariants checked, violations with their
trial's seed) goes to bench/results/fault_campaign-<machine>-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a command: its checks beside it

import fault_checks as checks  # noqa: E402
import procfs  # noqa: E402

from vx import faults  # noqa: E402

CREDS = {"AWS_ACCESS_KEY_ID": "vx-campaign", "AWS_SECRET_ACCESS_KEY": "vx-campaign-secret",
         "AWS_DEFAULT_REGION": "us-east-1"}
MODES = ["extract-hf", "extract-vllm", "regenerate", "one-pass", "two-writers", "two-writers-vllm"]
HF_MODES = ("extract-hf", "two-writers")  # no engine: cheap trials
TWO = ("two-writers", "two-writers-vllm")  # a second attempt of the output beside a paused first
WRITER = ["mid-shard-write", "before-shard-fsync", "before-rename", "before-manifest", "mid-manifest",
          "after-manifest"]
S3 = ["before-upload", "mid-upload", "after-upload", "before-s3-manifest", "after-s3-manifest", "after-delete"]
MULTIPART = ["upload-part", "before-multipart-complete"]
REGEN = ["after-chunk", "before-chunk-fsync", "before-committed-mark"]
TEXT = ["before-text-segment", "after-text-compact"]  # the one-pass mode's text in S3
ACTIONS = ["kill"] * 6 + ["eio"] * 2 + ["enospc"] + ["stall"]
SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}
# 0: it had printed its result before the signal was sent (a 0 without it: the signal was swallowed,
# as vLLM's engine start-up did until vx took it up); -15 / -2: it landed in the interpreter's last teardown, after
# Python gave the signals back to their default action: the shell's $? is 143 / 130 all the same
EXPECTED_RC = {"KILL": (-9,), "TERM": (143, -15, 0), "INT": (130, -2, 0)}
SIGNAL_EXIT_S, ORPHAN_S, RUN_S = 60.0, 30.0, 900.0
# the share of random trials on vLLM engines (extract-vllm, regenerate, one-pass): each takes
# ~20x an hf trial on CPU (engine starts); every engine failpoint and signal is in the coverage set
ENGINE_SHARE = 0.06


def draw(seed: int, index: int, modes: list[str]) -> dict:
    """Trial `index` of campaign `seed`. The first trials cover, once each, every failpoint the
    modes pass and every outside signal (in a configuration that reaches it, firing at its first
    or second pass); the rest are drawn at random."""
    rng = random.Random(seed * 1_000_003 + index)
    cover = coverage(modes)
    if index < len(cover):
        return forced(rng, index, seed, modes, cover[index])
    pool = configs(modes)
    engines = [c for c in pool if c["mode"] not in HF_MODES]
    if engines and len(engines) < len(pool) and rng.random() >= ENGINE_SHARE:
        pool = [c for c in pool if c["mode"] in HF_MODES]
    elif engines:
        pool = engines
    t = dict(rng.choice(pool), index=index, seed=seed)
    t["fault"] = draw_fault(rng, t)
    if t["mode"] in TWO:
        return t
    if rng.random() < 0.15 or t["fault"].get("name") == "mid-manifest":  # a crash during recovery too
        t["then"] = ({"kind": "point", "name": "repair-manifest", "nth": 1, "action": "kill"}
                     if t["fault"].get("name") == "mid-manifest" and rng.random() < 0.7 else draw_fault(rng, t))
    return t


def configs(modes: list[str]) -> list[dict]:
    """Every configuration a trial can run, with the weight of how often it is drawn (repeats)."""
    out = []
    for mode in modes:
        sinks = {"extract-hf": ["local", "s3", "s3", "s3-multipart"], "extract-vllm": ["local", "s3"],
                 "regenerate": ["local"], "one-pass": ["local", "s3"], "two-writers": ["s3", "s3", "s3-multipart"],
                 "two-writers-vllm": ["s3"]}[mode]
        for sink in sinks:
            for dp in ([1, 1, 2] if sink != "s3-multipart" else [1]):
                follows = [(False, False)] * 4 + [(True, False), (True, True)] if mode == "extract-hf" else [(False, False)]
                if sink == "s3-multipart":  # --retain-gb 0.005 is below one 5.5 MB shard: a bound no window fits
                    follows = [f for f in follows if not f[1]]
                for follow, retain in follows:
                    out.append({"mode": mode, "sink": sink, "dp": dp, "follow": follow, "retain": retain})
    return out


def coverage(modes: list[str]) -> list[tuple]:
    reach = {p for c in configs(modes) if c["mode"] not in TWO for p in points_for(c)}
    items = [("point", p) for p in faults.POINTS if p in reach]
    items += [("point", "repair-manifest")] if "mid-manifest" in reach else []
    crash = [c for c in configs(modes) if c["mode"] not in TWO]  # the modes signals are sent in
    targets = ["driver", "group"] + (["engine"] if any(c["mode"] != "extract-hf" for c in crash) else []) if crash else []
    targets += ["worker"] if any(c["dp"] == 2 for c in crash) else []
    return items + [("signal", tg, sig) for tg in targets for sig in SIGNALS] + [("two", m) for m in TWO if m in modes]


def _cheapest(ok: list[dict]) -> list[dict]:
    """One engine where the item allows it: a --dp 2 run starts three processes."""
    return [c for c in ok if c["dp"] == 1] or ok


def forced(rng: random.Random, index: int, seed: int, modes: list[str], item: tuple) -> dict:
    if item[0] == "two":
        t = dict(rng.choice(_cheapest([c for c in configs(modes) if c["mode"] == item[1]])), index=index, seed=seed)
        return dict(t, fault=draw_fault(rng, t))
    if item[0] == "signal":
        ok = [c for c in configs(modes) if c["mode"] not in TWO]
        ok = [c for c in ok if item[1] != "engine" or c["mode"] != "extract-hf"]
        ok = [c for c in ok if item[1] != "worker" or c["dp"] == 2]
        t = dict(rng.choice(_cheapest(ok)), index=index, seed=seed)
        t["fault"] = {"kind": "signal", "target": item[1], "sig": item[2], "at": rng.uniform(0.1, 0.7)}
        return t
    name = "mid-manifest" if item[1] == "repair-manifest" else item[1]
    t = dict(rng.choice(_cheapest([c for c in configs(modes) if c["mode"] not in TWO and name in points_for(c)])),
             index=index, seed=seed)
    many = name in ("mid-upload", "after-batch", "after-step", "engine-step", "mid-shard-write")
    t["fault"] = {"kind": "point", "name": name, "nth": rng.randint(1, 3) if many else 1, "action": rng.choice(ACTIONS)}
    if item[1] == "repair-manifest":
        t["fault"]["action"] = "kill"
        t["then"] = {"kind": "point", "name": "repair-manifest", "nth": 1, "action": rng.choice(ACTIONS)}
    return t


def points_for(t: dict) -> list[str]:
    if t["mode"] in TWO:  # where the first attempt pauses: each step of its uploader
        return S3 + (MULTIPART if t["sink"] == "s3-multipart" else [])
    pts = list(WRITER) if t["mode"] != "regenerate" else []
    pts += {"extract-hf": ["after-batch"], "extract-vllm": ["after-step", "engine-step", "engine-sample"],
            "regenerate": ["after-step"] + REGEN, "one-pass": REGEN}[t["mode"]]
    if t["sink"].startswith("s3"):
        pts += S3 + (MULTIPART if t["sink"] == "s3-multipart" else []) + (TEXT if t["mode"] == "one-pass" else [])
    if t["dp"] == 2:
        pts += ["before-plan-publish"] + (["after-merge"] if t["mode"] in ("regenerate", "one-pass") else [])
    if t["retain"]:
        pts += ["before-retain-delete", "after-retain-delete"]
    assert set(pts) <= set(faults.POINTS), set(pts) - set(faults.POINTS)
    return pts


def draw_fault(rng: random.Random, t: dict) -> dict:
    if t["mode"] in TWO:  # a pause (a cut-off or hung host), woken once the second attempt has finished
        return {"kind": "point", "name": rng.choice(points_for(t)), "nth": rng.randint(1, 4), "action": "stall"}
    if rng.random() < 0.3:
        targets = ["driver", "group"] + (["engine"] if "vllm" in t["mode"] or t["mode"] != "extract-hf" else [])
        targets += ["worker"] if t["dp"] == 2 else []
        return {"kind": "signal", "target": rng.choice(targets), "sig": rng.choice(list(SIGNALS)),
                "at": rng.random()}
    name = rng.choice(points_for(t))
    nth = rng.randint(1, {"mid-upload": 12, "engine-step": 12, "after-step": 8, "after-batch": 8}.get(name, 4))
    return {"kind": "point", "name": name, "nth": nth, "action": rng.choice(ACTIONS)}


class Campaign:
    def __init__(self, work: Path, url: str, client):
        self.work, self.url, self.client = work, url, client
        self.cache = work / "cache"  # the embedded model, built once
        self.data = {}
        self.reference = {}
        self.clean_s = {}

    # the datasets and the clean runs every trial is held against
    def prepare(self, modes: list[str]) -> None:
        rng = random.Random(0)
        words = "the of a model state layer token shard write crash rerun exactly once".split()

        def chats(n, long=False):
            return [{"id": f"c{i}", "messages": [
                {"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(3, 40 if long else 16)))},
                {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(3, 120 if long else 40)))}]}
                for i in range(n)]

        for name, rows in (("small", chats(40)), ("multipart", chats(40, long=True)),
                           ("prompts", [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
                                        for i in range(24)])):
            path = self.work / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            self.data[name] = (path, [r["id"] for r in rows])
        # the hf run of the small set: every trial's reference; every mode's: the span its signals' moments are drawn over
        # (a guess there drew most of the one pass's signals after its end)
        clean = [("extract-hf", "small")] + [(m, k) for m, k in (("extract-hf", "multipart"), ("extract-vllm", "small"),
                                                                 ("regenerate", "small"), ("one-pass", "small"))
                                             if m in modes or (k == "multipart" and "two-writers" in modes)]
        for mode, kind in clean:
            if (mode, kind) in self.clean_s:
                continue
            out = self.work / f"clean-{mode}-{kind}"
            t0 = time.monotonic()
            r = subprocess.run(self.command({"mode": mode, "sink": "local", "dp": 1, "retain": False, "kind": kind},
                                            out), env=self.env(), capture_output=True, text=True, cwd=ROOT)
            assert r.returncode == 0, r.stderr[-3000:]
            self.clean_s[(mode, kind)] = time.monotonic() - t0
            if mode == "extract-hf":  # the states every trial's rows are held against
                files = checks.Output.local(out)
                _, headers = checks.checksums_pass(files)
                self.reference[kind] = {k: v for name, h in headers.items()
                                        for k, v in checks.rows_of(files.files[name], h).items()}

    def render(self, messages: list[dict]) -> list[int]:
        """A conversation's ids as the embedded model's tokenizer renders it (its own chat template)."""
        if not hasattr(self, "_tokenizer"):
            from transformers import AutoTokenizer

            from vx.data.tiny import TINY_NAME

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.cache / TINY_NAME))
        text = self._tokenizer.apply_chat_template(messages, tokenize=False)
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]

    def env(self, extra: dict | None = None) -> dict:
        env = dict(os.environ, **CREDS, VX_CACHE_DIR=str(self.cache), OMP_NUM_THREADS="1",
                   VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        for k in ("VX_FAULT", "VX_FAULT_PARTITION", "VX_FAULT_ONCE", "VX_FAULT_TRACE"):
            env.pop(k, None)
        return dict(env, **(extra or {}))

    def command(self, t: dict, out) -> list[str]:
        vx = [sys.executable, "-m", "vx"]
        kind = t.get("kind", "multipart" if t["sink"] == "s3-multipart" else "small")
        if t["mode"] == "regenerate":
            return vx + ["regenerate", str(self.data["prompts"][0]), "-o", str(out), "--max-tokens", "6",
                         "--commit-every", "4", "--max-num-seqs", "4"] + (["--dp", "2"] if t["dp"] == 2 else [])
        data = self.data["prompts" if t["mode"] == "one-pass" else kind][0]
        cmd = vx + ["extract", str(data), "-o", str(out), "--json", "--progress-every", "1000"]
        if t["mode"] in HF_MODES:
            cmd += ["--backend", "hf", "--batch-size", "4"]
        else:
            cmd += ["--backend", "vllm", "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
        if t["mode"] == "one-pass":
            cmd += ["--regenerate", "--max-tokens", "8"]
        cmd += ["--shard-size", t.get("shard_mb") or ("5.5" if kind == "multipart" else "0.8")]  # ~4 and ~10 shards
        if str(out).startswith("s3://"):
            cmd += ["--endpoint-url", self.url]
        if t["dp"] == 2:
            cmd += ["--dp", "2"]
        if t["retain"]:
            cmd += ["--retain-gb", "0.005"]  # ~6 of the ~10 shards at a time
        return cmd

    def estimate(self, t: dict) -> float:
        """Seconds a clean run of this mode takes here (what a signal's random moment is drawn over)."""
        kind = "multipart" if t["sink"] == "s3-multipart" else "small"
        return self.clean_s.get((t["mode"], kind), 90.0 if t["mode"] not in HF_MODES else 15.0) * (1.5 if t["dp"] == 2 else 1)

    def run_trial(self, t: dict) -> dict:
        t0 = time.monotonic()
        r = self._trial(t)
        r["seconds"] = round(time.monotonic() - t0, 1)
        return r

    def _trial(self, t: dict) -> dict:
        tdir = self.work / f"t{t['seed']}-{t['index']:04d}"
        shutil.rmtree(tdir, ignore_errors=True)
        tdir.mkdir(parents=True)
        prefix = tdir.name
        if t["mode"] == "regenerate":
            out = tdir / "regenerated.jsonl"
        else:
            out = f"s3://vx-out/{prefix}" if t["sink"].startswith("s3") else tdir / "out"
        trace = tdir / "trace"
        result = {"trial": t, "runs": [], "violations": [], "invariants": 0}
        if t["mode"] in TWO:
            return self.two_writers(t, tdir, out, prefix, trace, result)
        reader = None
        steps = [t["fault"]] + ([t["then"]] if "then" in t else []) + [None]
        for i, fault in enumerate(steps):
            if t["follow"] and reader is None:
                reader = self.start_reader(out, tdir)
            run = self.run_once(t, out, fault, tdir / f"run{i}", trace)
            result["runs"].append(run)
            result["violations"] += run.pop("violations")
        result["invariants"] += 4 * len(steps)  # per run: ends by itself, no traceback, one-line error, no orphan
        final = result["runs"][-1]
        if final["rc"] != 0:
            result["violations"].append(f"the clean rerun failed (rc {final['rc']}): {final['stderr'][-600:]}")
            return self.finish(result, trace, reader)
        result["violations"] += self.check_output(t, out, prefix, result)
        if reader is not None:
            try:
                rc = reader.wait(timeout=180)
            except subprocess.TimeoutExpired:
                reader.kill()
                rc = "hung"
            result["invariants"] += 1
            if rc != 0:
                result["violations"].append(f"the follow reader ended {rc}: {(tdir / 'reader.log').read_text()[-600:]}")
            else:
                result["violations"] += checks.follow_saw_once(tdir / "seen.jsonl", self.ids(t))
        return self.finish(result, trace, None)

    def ids(self, t: dict) -> list[str]:
        if t["mode"] in ("regenerate", "one-pass"):
            return self.data["prompts"][1]
        return self.data["multipart" if t["sink"] == "s3-multipart" else "small"][1]

    def check_output(self, t: dict, out, prefix: str, result: dict) -> list[str]:
        want = self.ids(t)
        if t["mode"] == "regenerate":
            result["invariants"] += 2
            return checks.jsonl_once(Path(out), want) + checks.no_temp_files(Path(out).parent)
        remote = t["sink"].startswith("s3")
        files = checks.Output.s3(self.client, "vx-out", prefix) if remote else checks.Output.local(Path(out))
        bad = checks.exactly_once(files, want)
        sums, headers = checks.checksums_pass(files)
        bad += sums
        result["invariants"] += 2
        if t["mode"] == "one-pass":
            regen = files.files.get("regenerated.jsonl")
            path = Path(self.work / f"{prefix}-regenerated.jsonl")
            path.write_bytes(regen or b"")
            bad += checks.jsonl_once(path, want) + checks.text_matches_states(files, headers, regen or b"", self.render)
            result["invariants"] += 1
            if remote:  # the runs' segments compacted into one once the output is complete
                segments = [n for n in files.files if n.startswith("regenerated.jsonl.d/")]
                bad += [f"{len(segments)} text segments left in S3, not 1"] if len(segments) != 1 else []
                result["invariants"] += 1
        else:
            kind = "multipart" if t["sink"] == "s3-multipart" else "small"
            bad += checks.states_match(files, headers, self.reference[kind], 0.999 if t["mode"] in HF_MODES else 0.99)
        result["invariants"] += 1
        if remote:
            staging = list((self.cache / "staging").glob(f"*/vx-out/{prefix}"))
            bad += checks.s3_listing_agrees(files, self.client, "vx-out", prefix)
            if not t["retain"]:  # --retain-gb keeps uploaded shards staged until readers consumed them
                bad += checks.staging_empty(staging[0]) if staging else []
            bad += checks.no_temp_files(*staging)
            result["invariants"] += 3
        else:
            bad += checks.no_temp_files(Path(out))
            result["invariants"] += 1
        return bad

    def two_writers(self, t: dict, tdir: Path, out: str, prefix: str, trace: Path, result: dict) -> dict:
        """Two attempts of one S3 output from two staging directories (two hosts' vx caches): the
        first paused at its failpoint (a cut-off or hung host), the second run to its end beside
        it, then the first woken. The second exits 0; the first, where it was paused when the
        second started, stops with exit code 4 and one line naming the owner (a --dp 2 launcher:
        the line for its failed partition); then the output's invariants."""
        from vx.data.tiny import TINY_NAME

        fault, wake, host = t["fault"], tdir / "wake", tdir / "host-a"
        host.mkdir()
        (host / TINY_NAME).symlink_to((self.cache / TINY_NAME).resolve(), target_is_directory=True)
        run_id = f"{tdir.name}-first-{time.monotonic_ns()}"
        extra = {"VX_CACHE_DIR": str(host), "VX_FAULT_TRACE": str(trace), "VX_CAMPAIGN_RUN": run_id,
                 "VX_FAULT": f"{fault['name']}:{fault['nth']}:stall", "VX_FAULT_STALL_UNTIL": str(wake),
                 "VX_FAULT_STALL_S": str(RUN_S)}
        extra.update({"VX_FAULT_PARTITION": "0"} if t["dp"] == 2 else {})
        extra.update({"VX_S3_PART_MB": "5"} if t["sink"] == "s3-multipart" else {})
        log = tdir / "first"
        first = subprocess.Popen(self.command(t, out), env=self.env(extra), cwd=ROOT, start_new_session=True,
                                 stdout=open(log.with_suffix(".out"), "w"), stderr=open(log.with_suffix(".err"), "w"))
        deadline = time.monotonic() + RUN_S
        while first.poll() is None and time.monotonic() < deadline and \
                not (trace.exists() and "fired " in trace.read_text()):
            time.sleep(0.1)
        paused = first.poll() is None
        shard = "4.5" if t["sink"] == "s3-multipart" else "0.6"  # other samples under the same shard numbers
        second = self.run_once(dict(t, shard_mb=shard), out, None, tdir / "second", trace)
        result["runs"].append(second)
        result["violations"] += second.pop("violations")
        wake.touch()
        try:
            rc = first.wait(timeout=RUN_S)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
            rc = first.wait()
            result["violations"].append(f"the woken first attempt did not end within {RUN_S:.0f} s")
        left = procfs.tagged(f"VX_CAMPAIGN_RUN={run_id}".encode())
        stderr = log.with_suffix(".err").read_text(errors="replace")
        last = ([x for x in stderr.splitlines() if x.strip()] or [""])[-1]
        result["runs"].insert(0, {"fault": fault, "rc": rc, "paused": paused, "stderr": stderr[-300:],
                                  "exit_after_signal_s": None})
        result["invariants"] += 8  # the second's four, the first's: its exit, its line, no traceback, no orphan
        bad = []
        if second["rc"] != 0:
            bad.append(f"the second attempt failed (rc {second['rc']}): {second['stderr']}")
        if paused and t["dp"] == 1 and (rc != 4 or "taken over by another writer" not in last):
            bad.append(f"the first attempt, woken after the second, ended {rc}: {stderr[-600:]}")
        elif paused and t["dp"] == 2 and (rc == 0 or not last.startswith("vx")):
            bad.append(f"the first --dp 2 launcher, its partition woken after the second, ended {rc}: {stderr[-600:]}")
        elif not paused and rc != 0:
            bad.append(f"the first attempt, never paused, ended {rc}: {stderr[-600:]}")
        if "Traceback" in stderr:
            bad.append(f"the first attempt printed a traceback: {stderr[-1500:]}")
        if left:
            bad.append(f"processes of the first attempt outlived it: {left}")
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        result["violations"] += bad
        if second["rc"] == 0:
            result["violations"] += self.check_output(t, out, prefix, result)
        return self.finish(result, trace, None)

    def finish(self, result: dict, trace: Path, reader) -> dict:
        if reader is not None and reader.poll() is None:
            reader.kill()
        lines = trace.read_text().splitlines() if trace.exists() else []
        result["reached"] = sorted({x for x in lines if not x.startswith("fired ")})
        result["fired"] = [x[6:] for x in lines if x.startswith("fired ")]
        return result

    def start_reader(self, out, tdir: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", READER, str(out), self.url, str(tdir / "seen.jsonl"),
                                 str(tdir / "reader-cache")], env=self.env(), cwd=ROOT, start_new_session=True,
                                stdout=open(tdir / "reader.log", "w"), stderr=subprocess.STDOUT)

    def run_once(self, t: dict, out, fault: dict | None, log: Path, trace: Path) -> dict:
        # every process of this run, found by a mark vx does not set: its launcher's partition
        # workers and their engines included (VX_DRIVER names only the process that owns an engine)
        run_id = f"{log.parent.name}-{log.stem}-{time.monotonic_ns()}"
        tag = f"VX_CAMPAIGN_RUN={run_id}".encode()
        extra = {"VX_FAULT_TRACE": str(trace), "VX_CAMPAIGN_RUN": run_id}
        if t["sink"] == "s3-multipart":
            extra["VX_S3_PART_MB"] = "5"
        if fault and fault["kind"] == "point":
            extra.update(VX_FAULT=f"{fault['name']}:{fault['nth']}:{fault['action']}", VX_FAULT_STALL_S="2")
        t0 = time.monotonic()
        p = subprocess.Popen(self.command(t, out), env=self.env(extra), cwd=ROOT, start_new_session=True,
                             stdout=open(log.with_suffix(".out"), "w"), stderr=open(log.with_suffix(".err"), "w"))
        sent, unhandled, done = None, False, False
        if fault and fault["kind"] == "signal":
            when = t0 + fault["at"] * self.estimate(t)
            while p.poll() is None and time.monotonic() < when:
                time.sleep(0.05)
            pid = self.target_pid(p, fault["target"], tag) if p.poll() is None else None
            # a signal before the driver took the signals (vx/__main__.py does so first thing,
            # SIGTERM last) meets the interpreter's own start-up: the kernel's default action for
            # SIGTERM, Python's for SIGINT (a KeyboardInterrupt or a fatal error out of its init)
            unhandled = pid is not None and not procfs.catches(p.pid, signal.SIGTERM)
            done = log.with_suffix(".out").stat().st_size > 0  # its result printed: its work is over
            if pid is not None:
                try:
                    os.killpg(pid, SIGNALS[fault["sig"]]) if fault["target"] == "group" else \
                        os.kill(pid, SIGNALS[fault["sig"]])
                    sent = time.monotonic()
                except ProcessLookupError:
                    pass
        hung = worker_hung = False
        if sent and fault["target"] == "worker":  # the worker ends within the bound; the launcher reports it
            while procfs.alive(pid) and time.monotonic() - sent < SIGNAL_EXIT_S:  # once the others are done
                time.sleep(0.1)
            worker_hung = procfs.alive(pid)
        try:
            rc = p.wait(timeout=SIGNAL_EXIT_S if sent and fault["target"] != "worker" else RUN_S)
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(p.pid, signal.SIGKILL)
            rc = p.wait()
        ended = time.monotonic()
        left = procfs.tagged(tag)
        while left and time.monotonic() - ended < ORPHAN_S:
            time.sleep(0.2)
            left = procfs.tagged(tag)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stderr = log.with_suffix(".err").read_text(errors="replace")
        bad = []
        what = "the faulted run" if fault else "the clean rerun"
        if worker_hung:
            bad.append(f"the partition worker did not end within {SIGNAL_EXIT_S:.0f} s of SIG{fault['sig']}")
        if hung:
            bad.append(f"{what} did not end within {SIGNAL_EXIT_S if sent and fault['target'] != 'worker' else RUN_S:.0f} s"
                       + (f" of SIG{fault['sig']} to its {fault['target']}" if sent else ""))
        before_start = bool(sent and unhandled and rc != 0)  # what it says is then the interpreter's
        if sent and fault["target"] in ("driver", "group") and not hung and not before_start and \
                rc not in EXPECTED_RC[fault["sig"]]:
            bad.append(f"SIG{fault['sig']} to the {fault['target']}: exit code {rc}, not {EXPECTED_RC[fault['sig']]}")
        elif sent and fault["target"] in ("driver", "group") and fault["sig"] != "KILL" and rc == 0 and not done:
            bad.append(f"SIG{fault['sig']} to the {fault['target']} before its result: exit code 0 (the signal was "
                       "swallowed and the run went on)")
        if "Traceback" in stderr and not before_start:
            bad.append(f"{what} printed a traceback: {stderr[-1500:]}")
        last = ([x for x in stderr.splitlines() if x.strip()] or [""])[-1]
        # a signal after its result was printed meets vx's teardown: the signal's exit code, nothing said
        if not hung and rc not in (0, -9) and not last.startswith("vx") and not before_start and not done:
            bad.append(f"{what} ended {rc} without a one-line error: {stderr[-800:]}")
        if left:
            bad.append(f"processes outlived their driver by {ORPHAN_S:.0f} s: {left}")
        return {"fault": fault, "rc": rc, "seconds": round(ended - t0, 2), "hung": hung,
                "exit_after_signal_s": round(ended - sent, 2) if sent else None, "stderr": stderr[-300:],
                "before_start": bool(before_start),
                "violations": bad}

    def target_pid(self, p: subprocess.Popen, target: str, tag: bytes) -> int | None:
        if target in ("driver", "group"):
            return p.pid
        deadline = time.monotonic() + 60  # the engine or worker may still be starting
        while p.poll() is None and time.monotonic() < deadline:
            kids = procfs.tagged(tag)
            if target == "engine":
                found = [k for k in kids if procfs.cmdline(k).startswith(b"VLLM::EngineCore")]
            else:
                found = [k for k in kids if procfs.parent(k) == p.pid and b"VX_PARTITION=" in procfs.environ(k)]
            if found:
                return random.Random(p.pid).choice(found)
            time.sleep(0.1)
        return None


READER = """
import json, sys
import vx
out, url, seen, cache = sys.argv[1:5]
ld = vx.loader(out, 400, follow=True, follow_timeout=600, endpoint_url=url if out.startswith("s3://") else None,
               cache_dir=cache, shuffle_shards=2)
with open(seen, "w") as f:
    for i, b in enumerate(ld):
        if not b["padding"]:
            f.write(json.dumps(list(b["sample_ids"])) + "\\n")
            f.flush()
        if i % 2:
            ld.commit(ld.state_dict())
"""


def tally(results: list[dict], seed: int, seconds: float) -> dict:
    fired = [f for r in results for f in r["fired"]]
    return {
        "seed": seed, "trials": len(results), "seconds": round(seconds, 1),
        "modes": _count(r["trial"]["mode"] for r in results),
        "sinks": _count(r["trial"]["sink"] for r in results),
        "faults": _count(r["trial"]["fault"]["kind"] for r in results),
        "faults_fired": len(fired) + sum(1 for r in results for run in r["runs"] if run["exit_after_signal_s"] is not None),
        "failpoints_fired": _count(f.split(":")[0] for f in fired),
        "failpoints_reached": sorted({p for r in results for p in r["reached"]}),
        "failpoints_never_reached": sorted(set(faults.POINTS) - {p for r in results for p in r["reached"]}),
        "signals_sent": _count(f"{run['fault']['sig']}->{run['fault']['target']}" for r in results for run in r["runs"]
                               if run["exit_after_signal_s"] is not None),
        "max_exit_after_signal_s": max([run["exit_after_signal_s"] for r in results for run in r["runs"]
                                        if run["exit_after_signal_s"] is not None], default=None),
        "invariants_checked": sum(r["invariants"] for r in results),
        "violations": [{"trial": r["trial"], "what": v} for r in results for v in r["violations"]],
        "trial_seconds": {"mean": round(sum(r["seconds"] for r in results) / max(1, len(results)), 1),
                          "max": max((r["seconds"] for r in results), default=0)},
    }


def _count(items) -> dict:
    return dict(sorted(Counter(items).items()))


def start_s3():
    """moto's S3 server on a free loopback port, in this process, with the bucket vx-out."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"])
    client.create_bucket(Bucket="vx-out")
    return server, url, client


def run_campaign(trials: int, seed: int, work: Path, modes: list[str], jobs: int = 1, only: list[int] | None = None,
                 extra: list[dict] = (), log=print) -> dict:
    """`trials` drawn trials of campaign `seed` (or the trials `only` alone), then the `extra` trials as
    given (regressions: trials that once found a violation, as they were drawn)."""
    from vx.data.tiny import default_model_dir

    server, url, client = start_s3()
    try:
        camp = Campaign(work, url, client)
        model = default_model_dir()  # the embedded model of this process's cache, shared by the trials
        camp.cache.mkdir(parents=True, exist_ok=True)
        if not (camp.cache / model.name).exists():
            (camp.cache / model.name).symlink_to(model, target_is_directory=True)
        camp.prepare(modes + [t["mode"] for t in extra])
        todo = [draw(seed, i, modes) for i in (only if only is not None else range(trials))] + list(extra)
        t0 = time.monotonic()

        def one(t):
            r = camp.run_trial(t)
            log(f"trial {t['index']} (seed {t['seed']}): {t['mode']} {t['sink']} dp{t['dp']}"
                f"{' follow' if t['follow'] else ''}{' retain' if t['retain'] else ''} {_describe(t['fault'])}"
                f"{' then ' + _describe(t['then']) if 'then' in t else ''}: rc {[x['rc'] for x in r['runs']]}, "
                f"{r['seconds']:.0f} s, {len(r['violations'])} violations {r['violations'][:2]}")
            return r

        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(one, todo))
        return tally(results, seed, time.monotonic() - t0) | {"clean_run_s": {f"{m}/{k}": round(s, 1)
                                                                           for (m, k), s in camp.clean_s.items()}}
    finally:
        server.stop()


def _describe(f: dict) -> str:
    if f["kind"] == "signal":
        return f"SIG{f['sig']} to the {f['target']} at {f['at']:.2f}"
    return f"{f['name']}:{f['nth']}:{f['action']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--jobs", type=int, default=1, help="trials at a time")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--only", help="run these trials of the campaign alone (comma-separated numbers)")
    ap.add_argument("--work", help="keep the trials' files here (default: a temporary directory)")
    ap.add_argument("--results", help="results directory or .json file (default: bench/results/)")
    a = ap.parse_args()
    print(f"fault campaign: seed {a.seed}, {a.trials} trials, modes {a.modes}", file=sys.stderr, flush=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="vx-campaign-"))
    only = [int(x) for x in a.only.split(",")] if a.only else None
    t = run_campaign(a.trials, a.seed, work, a.modes.split(","), a.jobs, only,
                     log=lambda m: print(m, file=sys.stderr, flush=True))
    sys.path.insert(0, str(ROOT / "bench"))  # the benches' results file, for a long campaign run as a command
    from common import write_result

    path = write_result("fault_campaign", t, a.results)
    print(json.dumps({k: t[k] for k in ("trials", "faults_fired", "invariants_checked")} |
                     {"violations": len(t["violations"]), "results": str(path)}))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if t["violations"] else 0)


if __name__ == "__main__":
    main()
