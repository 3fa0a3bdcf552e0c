"""`vx.loader(path, ..., follow=True)`: the first epoch read while `vx extract` writes it.

The output is read as a stream of committed shards in an order every reader sees alike
(vx/store/stream.py). The stream is cut into windows of `shuffle_shards` consecutive positions;
window w is planned, once all its shards are committed (or the extraction has ended), from its
shards alone and (seed, epoch 0, w): samples shuffled within it, packed, evened out to a multiple
of world_size, dealt round robin. So every rank computes the same plan with no communication,
gets the same number of batches, and reads every sample once. A rank that runs ahead waits for
the window's last shard (`follow_timeout` s without a new commit is an error naming it).
`state_dict()` is the rank's batch position across windows: a resumed loader replans the windows
before it from their manifests, without reading them. Later epochs read the output as a finished
one (the whole-output plan), once the extraction has ended.

`commit(state)` records durably, beside the output (`.vx-readers/rank-R-of-W.json`, local or S3),
how many stream positions this rank has consumed: every window its checkpointed position has
passed. `vx extract --retain-gb` deletes shards every rank has consumed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from torch.utils.data import get_worker_info

from vx.errors import UsageError, VxError
from vx.store.format import READERS, RETAIN
from vx.store.lock import drop_dead_temps, write_atomically
from vx.store.stream import Stream
from vx.train.epoch_plan import Batch, Catalog, plan_window


class Follow:
    def __init__(self, loader):
        self.loader = loader
        self.stream = Stream(loader.path, loader.endpoint_url)
        self.records: list[dict] = []                            # the stream so far: a pass's shard table
        self.windows: list[tuple[Catalog, list[Batch]]] = []     # this rank's batches of each window
        self.poll = 1.0 if loader.path.startswith("s3://") else 0.2

    def _wait(self, ready, what) -> None:
        """Refresh the stream until ready(); an error after follow_timeout s with nothing new."""
        last = time.monotonic()
        self.stream.refresh()
        while not ready():
            time.sleep(self.poll)
            if self.stream.refresh():
                last = time.monotonic()
            elif time.monotonic() - last > min(60.0, self.loader.follow_timeout / 2):
                self._check_retention()
            if time.monotonic() - last > self.loader.follow_timeout:
                raise VxError(f"waited {self.loader.follow_timeout:.0f} s for {what()} of {self.loader.path} with "
                              "nothing new committed: is the extraction running? (vx.loader(..., follow_timeout=))")

    def _check_retention(self) -> None:
        """Stalled while --retain-gb holds the writer we wait for at its bound: no reader can commit
        the window it has not finished, so nothing will be freed. Say so instead of waiting."""
        st = self.stream
        part = st.next_writer()
        raw = st.src.read(RETAIN) if part is not None else None
        if raw is None:
            return
        policy = json.loads(raw)
        budget = policy["retain_gb"] * 1e9 / policy["writers"]
        held = st.held(part)
        if held and sum(held) + max(held) > budget:
            raise UsageError(
                f"vx extract --retain-gb {policy['retain_gb']:g} lets each of its {policy['writers']} writers hold "
                f"{budget / 1e9:.3g} GB of shards not every rank has committed; {part or 'the writer'} holds "
                f"{sum(held) / 1e9:.3g} GB, and this reader needs more of its shards before it can commit (a window is "
                f"shuffle_shards={self.loader.shuffle_shards} shards; ranks commit at checkpoints): raise --retain-gb, "
                "lower shuffle_shards, or commit more often")

    def meta_now(self) -> dict:
        self._wait(lambda: self.stream.meta is not None, self.stream.waiting_for)
        return self.stream.meta

    def complete(self) -> bool:
        self.stream.refresh()
        return self.stream.complete

    def window(self, w: int) -> bool:
        """Plan windows up to w (waiting for their shards); False when the stream ended before w."""
        size, ld = self.loader.shuffle_shards, self.loader
        while len(self.windows) <= w:
            v = len(self.windows)
            self._wait(lambda: len(self.stream) >= (v + 1) * size or self.stream.complete, self.stream.waiting_for)
            end = min((v + 1) * size, len(self.stream))
            if end <= v * size:
                return False
            self.records.extend(self.stream.record(q) for q in range(len(self.records), end))
            cat = Catalog(ld.path, ld.endpoint_url, records=self.records[v * size:end], meta=self.stream.meta,
                          shard_base=v * size)
            batches = plan_window(cat, ld.tokens_per_batch, ld.world_size, ld.seed, 0, v, ld.shuffle)[ld.rank]
            self.windows.append((cat, batches))
        return True

    def all_batches(self) -> list[Batch]:
        self._wait(lambda: self.stream.complete, self.stream.waiting_for)
        w = 0
        while self.window(w):
            w += 1
        return [b for _, batches in self.windows for b in batches]

    def ready(self, w: int) -> bool:
        """Whether window w can be planned now, without waiting."""
        size = self.loader.shuffle_shards
        if len(self.windows) > w or len(self.stream) >= (w + 1) * size or self.stream.complete:
            return True
        self.stream.refresh()
        return len(self.stream) >= (w + 1) * size or self.stream.complete

    def iterate(self):
        from vx.train.shard_cache import open_shards

        ld = self.loader
        info = get_worker_info()
        step, wid = (info.num_workers, info.id) if info else (1, 0)
        first = ld.position + wid
        starts = [0]  # this rank's index of the first batch of each planned window

        def mine(v: int) -> list[tuple[int, Batch]]:
            j = starts[v]
            return [(j + i, b) for i, b in enumerate(self.windows[v][1]) if j + i >= first and (j + i - first) % step == 0]

        plan: list[list[int]] = []  # shards of each batch this reader takes: the S3 cache fetches along it
        fed = 0                     # windows whose batches are in plan

        def feed(upto: int) -> None:
            nonlocal fed
            while fed <= upto:
                if len(starts) <= fed + 1:
                    starts.append(starts[fed] + len(self.windows[fed][1]))
                cat = self.windows[fed][0]
                plan.extend(list(dict.fromkeys(cat.shard_of[b.samples].tolist())) for _, b in mine(fed))
                fed += 1

        with open_shards(ld, f"r{ld.rank}-w{wid}", self.records, plan) as shards:
            w = k = 0
            while self.window(w):
                feed(w)
                if self.ready(w + 1) and self.window(w + 1):  # the next window's shards fetched during this one
                    feed(w + 1)
                cat = self.windows[w][0]
                for jj, b in mine(w):
                    shards.begin(k)
                    k += 1
                    batch = ld._assemble(cat, b, shards)
                    if info is None:
                        ld.position = jj + 1
                    yield batch
                w += 1

    def finished_catalog(self) -> Catalog:
        """Epochs after the first: the whole output, once the extraction has ended."""
        self._wait(lambda: self.stream.complete, self.stream.waiting_for)
        cat = Catalog(self.loader.path, self.loader.endpoint_url)
        dropped = self.stream.dropped()
        if dropped:
            raise UsageError(f"epoch {self.loader.epoch} needs {len(dropped)} shards of {self.loader.path} that "
                             "vx extract --retain-gb deleted once every reader had consumed them: train one epoch "
                             "while following, or extract again without --retain-gb to train more")
        return cat

    def consumed(self, state: dict) -> int:
        """Stream positions a rank at `state` has consumed: every window its position has passed."""
        if state["epoch"] >= 1:
            self._wait(lambda: self.stream.complete, self.stream.waiting_for)
            return len(self.stream)
        size, done, w = self.loader.shuffle_shards, 0, 0
        while done < state["position"] and self.window(w) and done + len(self.windows[w][1]) <= state["position"]:
            done += len(self.windows[w][1])
            w += 1
        return min(w * size, len(self.stream)) if self.stream.complete else w * size

    def commit(self, state: dict) -> None:
        ld = self.loader
        record = {"rank": ld.rank, "world_size": ld.world_size, "seed": ld.seed, "epoch": state["epoch"],
                  "position": state["position"], "shuffle_shards": ld.shuffle_shards,
                  "consumed": self.consumed(state), "time": time.time()}
        name = f"{READERS}/rank-{ld.rank:05d}-of-{ld.world_size:05d}.json"
        body = (json.dumps(record) + "\n").encode()
        src = self.stream.src
        if src.remote:
            src.client.put_object(Bucket=src.target.bucket, Key=src.target.key(name), Body=body)
            return
        path = Path(ld.path) / name
        path.parent.mkdir(exist_ok=True)
        drop_dead_temps(path.parent)  # a rank killed before its rename
        write_atomically(path, body, durable=True)
