"""The tool-call parser on canned model text: whole messages, and streams cut at every character."""
from __future__ import annotations

import json

import pytest

from specdec.server.tools import ToolCallParser, parse_tool_calls, supports_tools

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


def stream(text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list]:
    p = ToolCallParser(parallel)
    content, calls, last = "", [], 0
    for c in cuts + [len(text)]:
        d, new = p.feed(text[last:c])
        content, calls, last = content + d, calls + new, c
    d, new = p.finish()
    return content + d, calls + new


@pytest.mark.parametrize("text,content,names", [
    (CALL, None, ["get_weather"]),
    (CALL + "\n" + CALL2, None, ["get_weather", "get_time"]),
    ("Let me check.\n" + CALL, "Let me check.", ["get_weather"]),
    ("No tools needed: 4.", "No tools needed: 4.", []),
    ("a < b and <tool", "a < b and <tool", []),
    ('<tool_call>\n{"name": "x", "arguments": {"a": 1}}', None, ["x"]),  # EOS before the closing tag
    ("<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done", []),
    ("  \n", "  \n", []),
])
def test_whole_messages(text, content, names):
    got_content, calls = parse_tool_calls(text)
    assert got_content == content and [c.name for c in calls] == names
    for c in calls:
        assert isinstance(json.loads(c.arguments), dict) and c.id.startswith("call_")


def test_arguments_are_json_text_of_the_object():
    _, [call] = parse_tool_calls(CALL)
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    assert call.as_openai(0) == {"index": 0, "id": call.id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": call.arguments}}


@pytest.mark.parametrize("text", [CALL, "Sure. " + CALL + "\n" + CALL2, "plain text <b>bold</b>", CALL + " trailing"])
def test_streams_cut_anywhere_join_to_the_whole_message(text):
    whole_content, whole_calls = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        for cuts in ([cut], list(range(0, len(text), 3))):
            content, calls = stream(text, cuts)
            assert (content or None if calls else content) == whole_content, cuts
            assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_parallel_tool_calls_false_keeps_the_first_call():
    content, calls = parse_tool_calls(CALL + CALL2, parallel=False)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    assert [c.name for c in stream(CALL + CALL2, [5, 40, 90], parallel=False)[1]] == ["get_weather"]


def test_only_templates_with_a_tool_call_format_take_tools():
    assert supports_tools("{% if tools %}...<tool_call>...{% endif %}")
    assert not supports_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}") and not supports_tools(None)


NAMES = frozenset({"get_weather", "get_time"})
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("text,content,names", [
    (BARE, None, ["get_weather"]),  # the tags dropped, as small models do
    (BARE + "\n" + BARE.replace("weather", "time"), None, ["get_weather", "get_time"]),
    ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),  # not a declared tool
    (BARE + " and some prose", BARE + " and some prose", []),
    ('{"json": "as content"}', '{"json": "as content"}', []),
    ("Hi " + CALL, "Hi", ["get_weather"]),
])
def test_bare_json_calls_of_declared_tools(text, content, names):
    got, calls = parse_tool_calls(text, names=NAMES)
    assert got == content and [c.name for c in calls] == names
    for cuts in ([3], [1, 10, 30], list(range(len(text)))):
        p = ToolCallParser(names=NAMES)
        out, got_calls, last = "", [], 0
        for c in cuts + [len(text)]:
            d, new = p.feed(text[last:c])
            out, got_calls, last = out + d, got_calls + new, c
        d, new = p.finish()
        out, got_calls = out + d, got_calls + new
        assert ((out or None) if got_calls else out) == content and [c.name for c in got_calls] == names


def test_without_declared_names_bare_json_is_content():
    assert parse_tool_calls(BARE) == (BARE, [])


@pytest.mark.real
def test_qwen_calls_a_declared_tool():
    """Qwen2.5-Coder-0.5B, greedy, through its own template with tools: the parser finds the call."""
    from specdec import LLM, SamplingParams

    llm = LLM(model="qwen2.5-coder-0.5b", progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": params}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    text = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=60), tools=tools)[0].outputs[0].text
    content, calls = parse_tool_calls(text, names=frozenset({"get_weather"}))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
