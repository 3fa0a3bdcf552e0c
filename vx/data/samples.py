"""Dataset records -> token ids and loss masks, streamed.

Each record (a JSONL line, a parquet or arrow row; see vx/data/inputs.py) has one of four shapes:
  {"messages": [{"role": "user", "content": "..."}, ...], "tools": [...]}  (OpenAI / HF chat)
  {"conversations": [{"from": "human", "value": "..."}, ...]}              (ShareGPT)
  {"text": "..."}                                                           (plain text, loss on every token)
  {"input_ids": [...], "loss_mask": [...]}                                  (pre-tokenized; mask optional)
plus an optional "id" (default: the row number). Ids are kept as strings. The field names of
messages, text and id can be renamed (`Reading`, --messages-field and friends).

A bad record never stops the run: it becomes a `BadLine` (row, file, id, reason) that the
caller writes to errors.jsonl. Chat samples are rendered by vx/data/chat.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from vx.data.chat import ChatTemplate, conversation, tools_of
from vx.data.formats import BadRecord
from vx.data.inputs import Input, Row


@dataclass(frozen=True)
class Reading:
    """How records become samples. Everything here changes the tokens, so all of it keys the
    partition plan."""
    messages_field: str = "messages"
    text_field: str = "text"
    id_field: str = "id"
    chat_template: str | None = None   # template text (read from --chat-template FILE), None = the model's
    template_kwargs: str = "{}"        # JSON object, e.g. '{"enable_thinking": false}'
    max_length: int | None = None
    overlong: str = "truncate"

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class Sample:
    id: str
    line: int           # row number across the input
    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class BadLine:
    line: int
    id: str | None
    reason: str
    where: str = ""     # file:row

    def to_json(self) -> dict:
        file, _, row = self.where.rpartition(":")
        return {"line": self.line, "file": file or None, "row": int(row) if row else None, "id": self.id,
                "reason": self.reason}


class Tokenize:
    """Turns one record into (input_ids, loss_mask) with the model's own tokenizer."""

    def __init__(self, tokenizer, reading: Reading = Reading(), model_vocab: int | None = None):
        self.tok, self.reading = tokenizer, reading
        self.chat = ChatTemplate(tokenizer, reading.chat_template, json.loads(reading.template_kwargs))
        # vLLM's rule (validate_token_ids): an id is out of vocabulary at >= max(tokenizer, embedding rows)
        self.vocab_size = max(len(tokenizer), model_vocab or 0)

    def __call__(self, rec: dict) -> tuple[list[int], list[int]]:
        r = self.reading
        for field in dict.fromkeys((r.messages_field, "messages", "conversations")):
            if field in rec:
                return self.chat.encode(conversation(rec[field]), tools_of(rec))
        if r.text_field in rec:
            if not isinstance(rec[r.text_field], str):
                raise BadRecord(f"{r.text_field!r} is not a string")
            ids = list(self.tok(rec[r.text_field], add_special_tokens=True)["input_ids"])
            return ids, [1] * len(ids)
        if "input_ids" in rec:
            return self.pretokenized(rec)
        raise BadRecord(f"unknown shape: no {r.messages_field!r} (--messages-field), 'conversations', "
                        f"{r.text_field!r} (--text-field) or 'input_ids'; fields: {sorted(rec)[:8]}")

    def pretokenized(self, rec: dict) -> tuple[list[int], list[int]]:
        ids = rec["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise BadRecord("'input_ids' is not a list of integers")
        if any(x < 0 or x >= self.vocab_size for x in ids):
            raise BadRecord(f"'input_ids' has ids outside the vocabulary [0, {self.vocab_size})")
        mask = rec.get("loss_mask")
        if mask is None:
            return list(ids), [1] * len(ids)
        if not isinstance(mask, list) or len(mask) != len(ids) or any(x not in (0, 1) for x in mask):
            raise BadRecord("'loss_mask' must be a list of 0/1 of the same length as 'input_ids'")
        return list(ids), [int(x) for x in mask]

    def sample(self, rec: dict) -> tuple[list[int], list[int]]:
        """Tokens under the length policy: truncated, or refused with --overlong skip."""
        ids, mask = self(rec)
        if not ids:
            raise BadRecord("zero tokens")
        limit = self.reading.max_length
        if limit is not None and len(ids) > limit:
            if self.reading.overlong == "skip":
                raise BadRecord(f"{len(ids)} tokens > --max-length {limit} (--overlong skip)")
            ids, mask = ids[:limit], mask[:limit]
        return ids, mask

    def id_of(self, row: Row) -> str:
        raw = row.record.get(self.reading.id_field, row.index)
        if raw is None:
            raw = row.index
        if not isinstance(raw, (str, int)) or isinstance(raw, bool):
            raise BadRecord(f"{self.reading.id_field!r} must be a string or an integer")
        return str(raw)


PENDING = object()  # a following input has no committed row yet (vx/data/follow.py): step and ask again


def read_samples(data: Input | str | Path, tokenize, skip_ids: frozenset[str] | set[str] = frozenset(),
                 lines: set[int] | None = None, **reading) -> Iterator[Sample | BadLine]:
    """Stream the input, yielding a Sample or a BadLine for each non-blank row.

    `tokenize` is a Tokenize, or a tokenizer (then `reading` holds Reading's fields). Samples
    whose id is in `skip_ids` (already committed by an earlier run) are not yielded. With `lines`
    (a partition's row numbers) only those rows are tokenized and yielded; the others are still
    read for their ids, so a duplicate id is the same bad row whichever partition owns it.
    """
    if not isinstance(data, Input):
        data = Input(data)
    if not isinstance(tokenize, Tokenize):
        tokenize = Tokenize(tokenize, Reading(**reading))
    seen: set[str] = set()
    for row in data.rows():
        if row is PENDING:
            yield row
            continue
        if row.record is None and row.bad is None:
            continue  # a blank line
        sid = None
        mine = lines is None or row.index in lines
        try:
            if row.bad is not None:
                raise BadRecord(row.bad)
            sid = tokenize.id_of(row)
            if sid in seen:
                raise BadRecord(f"duplicate id {sid!r}")
            seen.add(sid)
            if not mine or sid in skip_ids:
                continue
            ids, mask = tokenize.sample(row.record)
            yield Sample(sid, row.index, ids, mask)
        except BadRecord as bad:
            if mine:
                yield BadLine(row.index, sid, str(bad), row.where)


def tokenize_for(model_dir: Path, reading: Reading = Reading()) -> Tokenize:
    """The Tokenize of a model directory: its tokenizer, and its embedding size for the vocab rule."""
    from vx.data.model import load_tokenizer, model_info

    return Tokenize(load_tokenizer(Path(model_dir)), reading, model_info(Path(model_dir)).vocab_size)
