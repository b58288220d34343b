"""The tool-call parser on canned model text: whole messages, and streams cut at every character."""
from __future__ import annotations

import json

import pytest

from specdec.server.tools import (CLOSE, OPEN, ToolCallParser, parse_tool_calls, supports_tools, tags_are_tokens,
                                 tool_call_grammar)

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


# ---- tool_choice "required" / named: the grammar of calls ------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"},
                                            "again": {"$ref": "#/properties/city"}},
           "required": ["city"], "additionalProperties": False, "$defs": {"Unit": {"enum": ["C", "F"]}}}
FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER},
             {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
             {"name": "ping"}]  # no parameters: arguments {}
W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C", "again": "x"}}\n</tool_call>'
T = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
P = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


def grammar_accepts(tok_dir, grammar: str, text: str) -> bool:
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    lltok = llguidance.hf.from_tokenizer(hf, eos_token=[hf.eos_token_id])
    g = LLMatcher.grammar_from_lark(grammar)
    assert LLMatcher.validate_grammar(g, lltok) == ""
    m = LLMatcher(lltok, g)
    ids = hf.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


@pytest.mark.parametrize("name,parallel,accepted", [
    (None, True, {W, T, P, W + "\n" + T, P + "\n" + P, T + "\n" + T}),
    (None, False, {W, T, P}),
    ("get_weather", False, {W}),
    ("get_time", True, {T, T + "\n" + T}),
])
def test_tool_call_grammar_accepts_exactly_the_calls_allowed(tiny_model_dir, name, parallel, accepted):
    g = tool_call_grammar(FUNCTIONS, name, parallel)
    bad_args = W.replace('"C"', '"K"')  # not in the enum
    loose = W.replace('": ', '":')  # not the compact separators
    extra = P.replace("{}", '{"x": 1}')  # ping takes no arguments
    for text in {W, T, P, W + "\n" + T, P + "\n" + P, T + "\n" + T, bad_args, loose, extra, "Sure. " + W}:
        assert grammar_accepts(tiny_model_dir, g, text) == (text in accepted), text
        if text in accepted:  # and the parser reads it back as calls
            content, calls = parse_tool_calls(text)
            assert content is None and all(name in (None, c.name) for c in calls) and calls


def test_tool_call_grammar_writes_added_tags_as_their_tokens(tiny_model_dir, tmp_path):
    """Qwen2.5's <tool_call> and </tool_call> are added tokens: the grammar uses those tokens."""
    from transformers import AutoTokenizer

    from specdec.formats.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert not tags_are_tokens(Tokenizer(tiny_model_dir))
    hf.add_tokens([OPEN, CLOSE])
    hf.save_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    assert tags_are_tokens(Tokenizer(tmp_path))
    assert len(hf.encode(P, add_special_tokens=False)) < len(hf.encode(P.replace("<", "< "), add_special_tokens=False))
    assert grammar_accepts(tmp_path, tool_call_grammar(FUNCTIONS, "ping", False, special_tags=True), P)
