"""Dataset lines -> token ids and loss masks, streamed.

One JSON object per line, in one of four shapes:
  {"messages": [{"role": "user", "content": "..."}, ...]}          (OpenAI / HF chat)
  {"conversations": [{"from": "human", "value": "..."}, ...]}      (ShareGPT)
  {"text": "..."}                                                   (plain text, loss on every token)
  {"input_ids": [...], "loss_mask": [...]}                          (pre-tokenized; mask optional)
plus an optional "id" (default: the 1-based line number). Ids are kept as strings.

A bad line never stops the run: it becomes a `BadLine` (line number, id, reason) that the
caller writes to errors.jsonl. The loss mask of a chat sample covers the assistant replies
(the template's `{% generation %}` blocks, or, for templates without them, the tokens each
assistant turn adds to the rendered prefix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool"}


@dataclass
class Sample:
    id: str
    line: int
    input_ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class BadLine:
    line: int
    id: str | None
    reason: str

    def to_json(self) -> dict:
        return {"line": self.line, "id": self.id, "reason": self.reason}


class _Bad(Exception):
    pass


class Tokenize:
    """Turns one parsed record into (input_ids, loss_mask) with the model's own tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        self.has_template = bool(template)
        self.has_generation_marks = "{% generation %}" in template or "{%- generation %}" in template
        self.vocab_size = len(tokenizer)

    def __call__(self, rec: dict) -> tuple[list[int], list[int]]:
        if "messages" in rec:
            return self.chat(self.messages(rec["messages"]))
        if "conversations" in rec:
            return self.chat(self.sharegpt(rec["conversations"]))
        if "text" in rec:
            if not isinstance(rec["text"], str):
                raise _Bad("'text' is not a string")
            ids = list(self.tok(rec["text"], add_special_tokens=True)["input_ids"])
            return ids, [1] * len(ids)
        if "input_ids" in rec:
            return self.pretokenized(rec)
        raise _Bad("unknown shape: expected one of 'messages', 'conversations', 'text', 'input_ids'")

    def messages(self, msgs) -> list[dict]:
        if not isinstance(msgs, list):
            raise _Bad("'messages' is not a list")
        out = []
        for m in msgs:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise _Bad("a message lacks 'role' or 'content'")
            if m["role"] not in ROLES:
                raise _Bad(f"unknown role {m['role']!r}")
            if not isinstance(m["content"], str):
                raise _Bad(f"non-string content in a {m['role']!r} message")
            out.append({"role": m["role"], "content": m["content"]})
        return out

    def sharegpt(self, turns) -> list[dict]:
        if not isinstance(turns, list):
            raise _Bad("'conversations' is not a list")
        out = []
        for t in turns:
            if not isinstance(t, dict) or "from" not in t or "value" not in t:
                raise _Bad("a turn lacks 'from' or 'value'")
            role = SHAREGPT_ROLES.get(t["from"])
            if role is None:
                raise _Bad(f"unknown role {t['from']!r}")
            if not isinstance(t["value"], str):
                raise _Bad(f"non-string content in a {t['from']!r} turn")
            out.append({"role": role, "content": t["value"]})
        return out

    def chat(self, msgs: list[dict]) -> tuple[list[int], list[int]]:
        if not msgs:
            raise _Bad("empty conversation")
        if not self.has_template:
            raise _Bad("the tokenizer has no chat template; give 'text' or 'input_ids' instead")
        if self.has_generation_marks:
            enc = self.tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            return list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
        return self.chat_by_prefixes(msgs)

    def chat_by_prefixes(self, msgs: list[dict]) -> tuple[list[int], list[int]]:
        """Loss mask for templates without generation marks: what each assistant turn appends."""
        def render(ms, gen):
            return list(self.tok.apply_chat_template(ms, tokenize=True, add_generation_prompt=gen,
                                                     return_dict=True)["input_ids"])
        ids = render(msgs, False)
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = render(msgs[:i], True) if i else []
            upto = render(msgs[: i + 1], False)
            if ids[: len(upto)] != upto or upto[: len(before)] != before:
                raise _Bad("chat template is not prefix-stable, cannot derive the assistant loss mask")
            end = len(upto)
            span = upto[len(before):]
            if self.tok.eos_token_id in span:  # stop at the turn's end token, like {% generation %}
                end = len(before) + len(span) - span[::-1].index(self.tok.eos_token_id)
            for j in range(len(before), end):
                mask[j] = 1
        return ids, mask

    def pretokenized(self, rec: dict) -> tuple[list[int], list[int]]:
        ids = rec["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise _Bad("'input_ids' is not a list of integers")
        if any(x < 0 or x >= self.vocab_size for x in ids):
            raise _Bad(f"'input_ids' has ids outside the vocabulary [0, {self.vocab_size})")
        mask = rec.get("loss_mask")
        if mask is None:
            return list(ids), [1] * len(ids)
        if not isinstance(mask, list) or len(mask) != len(ids) or any(x not in (0, 1) for x in mask):
            raise _Bad("'loss_mask' must be a list of 0/1 of the same length as 'input_ids'")
        return list(ids), [int(x) for x in mask]


def read_samples(path: Path, tokenizer, max_length: int | None = None, overlong: str = "truncate",
                 skip_ids: frozenset[str] | set[str] = frozenset(),
                 lines: set[int] | None = None) -> Iterator[Sample | BadLine]:
    """Stream `path` line by line, yielding a Sample or a BadLine for each non-blank line.

    Samples whose id is in `skip_ids` (already committed by an earlier run) are not yielded.
    With `lines` (a partition's 1-based line numbers) only those lines are tokenized and yielded;
    the others are still parsed for their ids, so a duplicate id is the same bad line whichever
    partition owns it.
    """
    tokenize = Tokenize(tokenizer)
    seen: set[str] = set()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            sid = None
            mine = lines is None or lineno in lines
            try:
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _Bad(f"line is not valid UTF-8 (byte {e.start})") from None
                try:
                    rec = json.loads(text)
                except json.JSONDecodeError as e:
                    raise _Bad(f"invalid JSON: {e.msg} at column {e.colno}") from None
                if not isinstance(rec, dict):
                    raise _Bad("line is not a JSON object")
                raw_id = rec.get("id", lineno)
                if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool):
                    raise _Bad("'id' must be a string or an integer")
                sid = str(raw_id)
                if sid in seen:
                    raise _Bad(f"duplicate id {sid!r}")
                seen.add(sid)
                if not mine or sid in skip_ids:
                    continue
                ids, mask = tokenize(rec)
                if not ids:
                    raise _Bad("zero tokens")
                if max_length is not None and len(ids) > max_length:
                    if overlong == "skip":
                        raise _Bad(f"{len(ids)} tokens > --max-length {max_length} (--overlong skip)")
                    ids, mask = ids[:max_length], mask[:max_length]
                yield Sample(sid, lineno, ids, mask)
            except _Bad as bad:
                if mine:
                    yield BadLine(lineno, sid, str(bad))


def count_lines(path: Path) -> int:
    """Non-blank lines, counted fast for the progress bar's total."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                n += 1
    return n
