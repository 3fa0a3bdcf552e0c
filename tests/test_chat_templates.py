"""Chat templates as users meet them: a Qwen3-style template with no {% generation %} blocks that
renders <think> sections (and drops the thinking of turns before the last user query), tool calls,
a tools list, reasoning_content, the thinking switch and a template file given on the command
line. The loss mask covers exactly the assistant's generated text: each check below decodes the
masked token runs and compares them with the text written out by hand."""

import json

import vx
from conftest import write_jsonl
from test_cli import vx_cmd
from vx.data.samples import Reading, Tokenize

QWEN3_STYLE = """\
{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is not none else '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
{%- if m.tool_calls %}{%- for tc in m.tool_calls %}{%- set f = tc.function if tc.function is defined else tc %}
{{- '\\n<tool_call>\\n{"name": "' + f.name + '", "arguments": ' + (f.arguments if f.arguments is string else f.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

TWO_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
             {"role": "user", "content": "And 3+3?"},
             {"role": "assistant", "content": "<think>\nAdd again.\n</think>\n\n6"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_USE = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "It is 18C."}]


def masked_runs(tokenizer, ids, mask) -> list[str]:
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def encode(tokenizer, rec, **kwargs):
    reading = Reading(chat_template=QWEN3_STYLE, template_kwargs=json.dumps(kwargs))
    return Tokenize(tokenizer, reading)(rec)


def test_thinking_is_in_the_loss_where_the_template_renders_it(tokenizer):
    ids, mask = encode(tokenizer, {"messages": TWO_TURNS})
    assert "Add them." not in tokenizer.decode(ids)  # the template drops thinking before the last query
    assert masked_runs(tokenizer, ids, mask) == ["4<|im_end|>", "<think>\nAdd again.\n</think>\n\n6<|im_end|>"]


def test_thinking_off_leaves_the_prompted_empty_think_block_out_of_the_loss(tokenizer):
    ids, mask = encode(tokenizer, {"messages": TWO_TURNS[:3]}, enable_thinking=False)
    assert "<think>\nAdd them.\n</think>" in tokenizer.decode(ids)
    assert masked_runs(tokenizer, ids, mask) == ["<think>\nAdd them.\n</think>\n\n4<|im_end|>"]
    ids, mask = encode(tokenizer, {"messages": TWO_TURNS[:2] + [{"role": "assistant", "content": "4"}]},
                       enable_thinking=False)
    assert "<think>\n\n</think>\n\n4" in tokenizer.decode(ids)
    assert masked_runs(tokenizer, ids, mask) == ["4<|im_end|>"]


def test_tool_calls_are_generated_text_and_tool_results_and_the_tools_list_are_not(tokenizer):
    ids, mask = encode(tokenizer, {"messages": TOOL_USE, "tools": json.dumps(TOOLS)}, enable_thinking=False)
    text = tokenizer.decode(ids)
    assert '"name": "get_weather", "parameters"' in text and "<tool_response>\n18C" in text
    runs = masked_runs(tokenizer, ids, mask)
    assert [r.strip() for r in runs] == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is 18C.<|im_end|>"]


def test_a_template_file_and_its_kwargs_given_on_the_command_line_shape_the_stored_mask(tmp_path, tokenizer):
    (tmp_path / "qwen3.jinja").write_text(QWEN3_STYLE)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "t", "messages": TWO_TURNS[:2] + [
        {"role": "assistant", "content": "4"}]}])
    r = vx_cmd("extract", str(data), "-o", str(tmp_path / "out"), "--backend", "hf", "--json",
               "--chat-template", str(tmp_path / "qwen3.jinja"),
               "--chat-template-kwargs", '{"enable_thinking": false}')
    assert r.returncode == 0, r.stderr
    item = vx.open_dataset(tmp_path / "out")["t"]
    ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
    assert "<think>\n\n</think>\n\n4<|im_end|>" in tokenizer.decode(ids)
    assert masked_runs(tokenizer, ids, mask) == ["4<|im_end|>"]
    bad = vx_cmd("extract", str(data), "-o", str(tmp_path / "out2"), "--chat-template-kwargs", "[1]")
    assert bad.returncode == 2 and "JSON object" in bad.stderr
