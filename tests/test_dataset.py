"""Dataset lines -> tokens: every bad line is recorded, never fatal unless --strict."""

import json

import pytest

from vx.jobs.config import ExtractConfig
from vx.data.samples import BadLine, Sample, read_samples
from vx.errors import UsageError
from vx.jobs.extract import run_extract

from conftest import write_jsonl

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

BAD_LINES = {
    "invalid JSON": '{"messages": [',
    "unknown shape": {"prompt": "hello"},
    "empty conversation": {"messages": []},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "non-string content": {"messages": [{"role": "user", "content": 42}]},
    "non-text content parts": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    "zero tokens": {"input_ids": []},
    "tokens > --max-length": {"text": "word " * 200},
    "not valid UTF-8": b'{"text": "caf\xe9"}',
    "duplicate id": {"id": "dup", "text": "second"},
}


def test_each_bad_line_kind_yields_one_error_record_and_the_run_completes(tiny_model, tmp_path):
    rows = [dict(GOOD, id="ok-1"), {"id": "dup", "text": "first"}]
    rows += list(BAD_LINES.values())
    rows += [dict(GOOD, id="ok-2")]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = ExtractConfig(data=data, output=tmp_path / "out", backend="hf", max_length=100, overlong="skip")
    summary = run_extract(cfg, progress=False)
    assert summary.samples == 3 and summary.errors == len(BAD_LINES)
    errors = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert [e["line"] for e in errors] == list(range(3, 3 + len(BAD_LINES)))
    for (kind, _), err in zip(BAD_LINES.items(), errors):
        assert kind in err["reason"], (kind, err)
    assert errors[-1]["id"] == "dup"


def test_strict_fails_before_any_compute(tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, {"messages": []}])
    cfg = ExtractConfig(data=data, output=tmp_path / "out", backend="hf", strict=True)
    with pytest.raises(UsageError, match=r"d.jsonl:3: empty conversation"):
        run_extract(cfg, progress=False)
    assert not (tmp_path / "out").exists()


def test_loss_mask_covers_exactly_the_assistant_replies(tokenizer, tmp_path):
    conv = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Bye"},
                         {"role": "assistant", "content": "See you"}]}
    [s] = read_samples(write_jsonl(tmp_path / "d.jsonl", [conv]), tokenizer)
    masked = [t for t, m in zip(s.input_ids, s.loss_mask) if m]
    assert tokenizer.decode(masked) == "Hello there<|im_end|>See you<|im_end|>"
    # ShareGPT shape gives the same tokens and mask
    sg = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                            {"from": "gpt", "value": "Hello there"}, {"from": "human", "value": "Bye"},
                            {"from": "gpt", "value": "See you"}]}
    [t] = read_samples(write_jsonl(tmp_path / "e.jsonl", [sg]), tokenizer)
    assert (t.input_ids, t.loss_mask) == (s.input_ids, s.loss_mask)


def test_templates_without_generation_marks_give_the_mask_the_marks_give(tokenizer):
    from vx.data.chat import ChatTemplate

    unmarked = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "See you"}]
    marked = ChatTemplate(tokenizer).encode(msgs)  # HF's own assistant mask from {% generation %}
    assert sum(marked[1]) > 0
    assert ChatTemplate(tokenizer, unmarked).encode(msgs) == marked
    assert ChatTemplate(tokenizer, unmarked)._by_prefixes(msgs, None) == marked


def test_pretokenized_text_ids_and_truncation(tokenizer, tmp_path):
    rows = [{"id": 7, "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, {"text": "hello world " * 50}]
    items = list(read_samples(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_length=10))
    assert all(isinstance(i, Sample) for i in items)
    assert (items[0].id, items[0].input_ids, items[0].loss_mask) == ("7", [5, 6, 7, 8], [0, 0, 1, 1])
    assert len(items[1]) == 10 and items[1].id == "2" and set(items[1].loss_mask) == {1}


def test_ids_outside_the_vocabulary_are_bad_lines(tokenizer, tmp_path):
    [item] = read_samples(write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 10**7]}]), tokenizer)
    assert isinstance(item, BadLine) and "vocabulary" in item.reason


def test_a_sample_whose_states_go_bad_is_recorded_with_its_line_and_not_committed(tiny_model, tmp_path, monkeypatch):
    import torch

    from vx.engine import hf_extractor as hf_backend

    real_extract = hf_backend.HFExtractor.extract

    def corrupt(self, batch):  # inject: NaN states for one sample, an all-zero layer for another
        out = [h.clone() for h in real_extract(self, batch)]
        for s, h in zip(batch, out):
            if s.id == "nan":
                h[0, 0, 0] = float("nan")
            if s.id == "zero":
                h[:, 1] = 0
        return out

    monkeypatch.setattr(hf_backend.HFExtractor, "extract", corrupt)
    rows = [dict(GOOD, id="ok"), dict(GOOD, id="nan"), dict(GOOD, id="zero"), dict(GOOD, id="ok2")]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    summary = run_extract(ExtractConfig(data=data, output=tmp_path / "out", backend="hf"), progress=False)
    errors = {e["id"]: e for e in map(json.loads, (tmp_path / "out" / "errors.jsonl").read_text().splitlines())}
    assert set(errors) == {"nan", "zero"} and errors["nan"]["line"] == 2 and errors["zero"]["line"] == 3
    assert "NaN" in errors["nan"]["reason"] and "all zero" in errors["zero"]["reason"]
    import vx

    assert sorted(vx.open_dataset(tmp_path / "out").ids) == ["ok", "ok2"] and summary.samples == 2
    assert torch.isfinite(vx.open_dataset(tmp_path / "out")["ok"]["hidden_states"].float()).all()
