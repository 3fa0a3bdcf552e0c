"""Chat conversations -> token ids and the assistant loss mask, through the model's chat template.

The loss mask covers exactly what the assistant generated in each of its turns: its text, its
thinking when the template renders it, its tool calls, and the turn's end token. Templates
with `{% generation %}` blocks say so themselves (HF's assistant mask). For the others (Qwen3's,
which renders `<think>` sections and drops the thinking of turns before the last user query, so
a conversation's rendering is not a prefix of its longer renderings), the turns are found in the
rendered text: each assistant turn starts after the template's assistant header (plus whatever
else its generation prompt gives the model, e.g. an empty think block when thinking is off) and
ends with the template's end-of-turn marker. Both are learned once by rendering a probe
conversation; the character spans map to tokens through the tokenizer's offsets.
"""

from __future__ import annotations

import json
from pathlib import Path

from vx.data.formats import BadRecord
from vx.errors import UsageError

ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function": "tool", "observation": "tool"}
PROBE = "vx7probe"


class ChatTemplate:
    def __init__(self, tokenizer, template: str | None = None, kwargs: dict | None = None):
        self.tok, self.kwargs = tokenizer, dict(kwargs or {})
        self.template = template
        text = template if template is not None else (getattr(tokenizer, "chat_template", None) or "")
        if isinstance(text, dict):  # several named templates: the default one
            text = text.get("default", next(iter(text.values()), ""))
        self.available = bool(text)
        self.marked = "{% generation %}" in text or "{%- generation %}" in text
        self.eos = tokenizer.eos_token_id
        self.header = self.prompt_extra = self.end = None
        if self.available and not self.marked and getattr(tokenizer, "is_fast", False):
            self._learn_turn_shape()

    def render(self, msgs: list[dict], tools=None, gen: bool = False) -> str:
        return self.tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen,
                                            chat_template=self.template, **self.kwargs)

    def _learn_turn_shape(self) -> None:
        """The assistant header, the extra text of the generation prompt and the end-of-turn marker."""
        user = [{"role": "user", "content": "x"}]
        try:
            base, prompt = self.render(user), self.render(user, gen=True)
            middle = self.render(user + [{"role": "assistant", "content": PROBE}, {"role": "user", "content": "y"}])
            last = self.render(user + [{"role": "assistant", "content": PROBE}])
        except Exception:
            return
        if not (prompt.startswith(base) and middle.startswith(base) and PROBE in middle and PROBE in last):
            return
        gen, mid = prompt[len(base):], middle[len(base):middle.index(PROBE)]
        n = 0
        while n < min(len(gen), len(mid)) and gen[n] == mid[n]:
            n += 1
        end = last[last.index(PROBE) + len(PROBE):].rstrip()
        if n and end:
            self.header, self.prompt_extra, self.end = gen[:n], gen[n:], end

    def encode(self, msgs: list[dict], tools=None) -> tuple[list[int], list[int]]:
        if not self.available:
            raise BadRecord("the tokenizer has no chat template; give --chat-template, 'text' or 'input_ids'")
        try:
            if self.marked:
                enc = self.tok.apply_chat_template(msgs, tools=tools, tokenize=True, return_dict=True,
                                                   return_assistant_tokens_mask=True, chat_template=self.template,
                                                   **self.kwargs)
                return list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]
            if self.header is not None:
                return self._by_spans(msgs, tools)
            return self._by_prefixes(msgs, tools)
        except BadRecord:
            raise
        except Exception as e:  # the template itself refused (roles out of order, missing fields)
            raise BadRecord(f"chat template error: {type(e).__name__}: {e}") from None

    def _by_spans(self, msgs, tools) -> tuple[list[int], list[int]]:
        text = self.render(msgs, tools)
        spans, at = [], 0
        for m in msgs:
            if m["role"] != "assistant":
                continue
            h = text.find(self.header, at)
            if h < 0:
                raise BadRecord("chat template renders fewer assistant headers than assistant turns")
            start = h + len(self.header)
            if self.prompt_extra and text.startswith(self.prompt_extra, start):
                start += len(self.prompt_extra)  # given to the model by the generation prompt
            end = text.find(self.end, start)
            if end < 0:
                raise BadRecord("an assistant turn has no end-of-turn marker in the rendered template")
            at = end + len(self.end)
            spans.append((start, at))
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, mask, k = list(enc["input_ids"]), [], 0
        for a, _ in enc["offset_mapping"]:
            while k < len(spans) and a >= spans[k][1]:
                k += 1
            mask.append(int(k < len(spans) and spans[k][0] <= a))
        return ids, mask

    def _by_prefixes(self, msgs, tools) -> tuple[list[int], list[int]]:
        """Slow tokenizers or unusual templates: the tokens each assistant turn adds to the prefix."""
        def ids_of(ms, gen):
            return list(self.tok.apply_chat_template(ms, tools=tools, tokenize=True, add_generation_prompt=gen,
                                                     return_dict=True, chat_template=self.template,
                                                     **self.kwargs)["input_ids"])
        ids = ids_of(msgs, False)
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = ids_of(msgs[:i], True) if i else []
            upto = ids_of(msgs[: i + 1], False)
            if ids[: len(upto)] != upto or upto[: len(before)] != before:
                raise BadRecord("chat template is not prefix-stable, cannot derive the assistant loss mask")
            end = len(upto)
            span = upto[len(before):]
            if self.eos in span:  # stop at the turn's end token, like {% generation %}
                end = len(before) + len(span) - span[::-1].index(self.eos)
            for j in range(len(before), end):
                mask[j] = 1
        return ids, mask


def conversation(turns) -> list[dict]:
    """OpenAI/HF messages or ShareGPT turns -> messages for the template, extra keys kept
    (tool_calls, reasoning_content, name, tool_call_id); null fields (parquet structs) dropped."""
    if not isinstance(turns, list):
        raise BadRecord("the conversation is not a list")
    if not turns:
        raise BadRecord("empty conversation")
    return [_sharegpt(t) if isinstance(t, dict) and "from" in t else _message(t) for t in turns]


def _message(m) -> dict:
    if not isinstance(m, dict) or "role" not in m:
        raise BadRecord("a message lacks 'role'")
    if m["role"] not in ROLES:
        raise BadRecord(f"unknown role {m['role']!r}")
    out = {k: v for k, v in m.items() if v is not None}
    content = m.get("content")
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        if not all(isinstance(p, str) for p in parts):
            raise BadRecord(f"a {m['role']!r} message has non-text content parts")
        content = "".join(parts)
    if content is None and (out.get("tool_calls") or out.get("reasoning_content")):
        content = ""
    if not isinstance(content, str):
        raise BadRecord(f"{'no' if content is None else 'non-string'} content in a {m['role']!r} message")
    out["content"] = content
    return out


def _sharegpt(t) -> dict:
    if "value" not in t:
        raise BadRecord("a turn lacks 'from' or 'value'")
    role = SHAREGPT_ROLES.get(t["from"])
    if role is None:
        raise BadRecord(f"unknown role {t['from']!r}")
    if not isinstance(t["value"], str):
        raise BadRecord(f"non-string content in a {t['from']!r} turn")
    return {"role": role, "content": t["value"]}


def tools_of(rec: dict):
    tools = rec.get("tools")
    if isinstance(tools, str):  # datasets often keep the tool list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadRecord("'tools' is a string but not JSON") from None
    if tools is not None and not isinstance(tools, list):
        raise BadRecord("'tools' is not a list")
    return tools or None


def check_template_options(chat_template: str | None, chat_template_kwargs: str | None) -> dict:
    """--chat-template must be a file, --chat-template-kwargs a JSON object; returns the kwargs
    (shared by extract and regenerate)."""
    import json

    if chat_template is not None and not Path(chat_template).is_file():
        raise UsageError(f"--chat-template {chat_template!r} is not a file")
    try:
        kwargs = json.loads(chat_template_kwargs or "{}")
    except json.JSONDecodeError as e:
        raise UsageError(f"--chat-template-kwargs is not JSON: {e.msg}") from None
    if not isinstance(kwargs, dict):
        raise UsageError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return kwargs
