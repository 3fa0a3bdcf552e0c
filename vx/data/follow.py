"""A dataset that another process is still writing: `vx regenerate`'s output, read as it commits.

`vx extract --regenerate` captures each conversation the moment the regeneration beside it has
committed it: rows come from OUTPUT up to its durable size (OUTPUT.committed, written after each
fsync, vx/store/text_output.py), so nothing captured can vanish with an unsynced chunk. The
input ends once the writer says it is done and every committed row was read.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

from vx.data.formats import BadRecord, parse_line
from vx.data.inputs import Input, InputFile, Row
from vx.data.samples import PENDING
from vx.store.text_output import COMMITTED


def committed_bytes(path: Path) -> int:
    """How much of a followed file is durable (0 before its first commit)."""
    try:
        return int(Path(str(path) + COMMITTED).read_text())
    except (FileNotFoundError, ValueError):
        return 0


class FollowingInput(Input):
    """OUTPUT's committed rows as they commit. finished(): True once the writer is done (it raises
    when the writer failed). pending: yield PENDING while waiting (a consumer with work in flight
    keeps it moving), else sleep."""

    def __init__(self, path: Path, finished: Callable[[], bool], pending: bool = False, poll_s: float = 0.05,
                 after_end: bool = False):
        self.path, self.finished, self.pending, self.poll_s = Path(path), finished, pending, poll_s
        self.after_end = after_end  # read nothing before the writer is done (it keeps the cores until then)
        super().__init__(str(path), files=[InputFile(str(path), 0)])

    def rows(self) -> Iterator[Row | object]:
        offset = index = 0
        f = self.files[0]
        while True:
            done = self.finished()  # asked before reading: a read after it sees every committed row
            end = committed_bytes(self.path) if done or not self.after_end else offset
            if end > offset:
                with open(self.path, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read(end - offset)
                offset = end
                for raw in data.split(b"\n")[:-1]:  # a commit ends on a newline
                    index += 1
                    if not raw.strip():
                        yield Row(index, f, index, None)
                        continue
                    try:
                        yield Row(index, f, index, parse_line(raw))
                    except BadRecord as e:
                        yield Row(index, f, index, None, str(e))
                continue
            if done:
                return
            if self.pending:
                yield PENDING
            else:
                time.sleep(self.poll_s)

    def count(self) -> int | None:
        return None

    def fingerprint(self) -> str:
        return f"following:{self.path}"
