"""Structured output through the server and the official openai client: ``response_format``
(json_schema, json_object), vLLM's ``structured_outputs`` and ``guided_*`` fields, streamed and not;
``tool_choice`` ``required`` and a named function (the output constrained to the model's own
``<tool_call>`` blocks, returned as ``tool_calls``); and a 400 naming the field for every malformed
or invalid constraint, after which the server still answers. The tiny random model writes whatever
the grammar allows, so the schemas are small and bounded (maxLength, enum, integer ranges)."""
from __future__ import annotations

import json
import re

import pytest

from server_util import KEY, ServerProcess, chat_choice, templated_model

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# tools named in the system turn (short: the tiny tokenizer spells JSON a byte at a time)
TEMPLATE = ("{%- if tools %}<|im_start|>system\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
            "</tool_call>: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}"
            "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
USER = [{"role": "user", "content": "Weather in Paris?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "temp": {"type": "integer", "minimum": -50, "maximum": 50},
                                           "unit": {"enum": ["C", "F"]}},
          "required": ["city", "temp", "unit"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"$ref": "#/$defs/U"}},
           "required": ["city", "unit"], "additionalProperties": False, "$defs": {"U": {"enum": ["C", "F"]}}}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = templated_model(tmp_path_factory.mktemp("structured"), TEMPLATE, 1024)
    srv = ServerProcess(model, "--speculative-model", str(model), "--num-speculative-tokens", "4", api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ids(server) -> dict[str, str]:
    """Token ids (as logit_bias keys) of '"', '}' and the end of sequence in the server's vocabulary."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(server.model)
    return {t: str(tok.convert_tokens_to_ids(t)) for t in ('"', "}", "<|im_end|>")}


def chat(client, server, stream: bool, **kw) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as dicts, finish reason) of one chat choice, streamed deltas joined."""
    return chat_choice(client, **(dict(model=server.model, messages=USER, max_tokens=200, temperature=0) | kw),
                       stream=stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_response_format_json_schema(server, client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        content, calls, finish = chat(client, server, stream, response_format=fmt, seed=seed,
                                      temperature=temperature)
        assert finish == "stop" and not calls, content
        jsonschema.validate(json.loads(content), SCHEMA)
        assert content == json.dumps(json.loads(content), ensure_ascii=False)  # compact, json.dumps's separators
    # greedy: the streamed text is the whole one
    assert chat(client, server, False, response_format=fmt)[0] == chat(client, server, True, response_format=fmt)[0]


def test_response_format_json_object(server, client, ids):
    # a random model's strings are endless: sampled with a bias on '"' and '}', they (and the object) end soon
    bias = {ids['"']: 6, ids["}"]: 6}
    for stream in (False, True):
        content, _, finish = chat(client, server, stream, response_format={"type": "json_object"}, logit_bias=bias,
                                  temperature=1.0, seed=3)
        assert finish == "stop" and isinstance(json.loads(content), dict), content
    content, _, _ = chat(client, server, False, response_format={"type": "text"}, max_tokens=5)
    assert content is not None  # text: no constraint


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_vllm_fields_on_completions(server, client, stream):
    cases = [({"structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{2}"}},
              lambda t: re.fullmatch("[a-z]{2,6}-[0-9]{2}", t)),
             ({"guided_regex": "(yes|no), [0-9]"}, lambda t: re.fullmatch("(yes|no), [0-9]", t)),
             ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
             ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
             ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             ({"guided_grammar": 'start: "x=" N ";"\nN: /[0-9]{1,3}/'}, lambda t: re.fullmatch("x=[0-9]{1,3};", t))]
    for extra, ok in cases:
        args = dict(model=server.model, prompt="The quick brown fox", max_tokens=100, temperature=1.0, seed=2,
                    extra_body=extra)
        if stream:
            chunks = list(client.completions.create(stream=True, **args))
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            c = client.completions.create(**args).choices[0]
            text, finish = c.text, c.finish_reason
        assert finish == "stop" and ok(text), (extra, text)


def test_vllm_fields_on_chat(server, client):
    for extra in ({"guided_choice": ["sunny", "rainy"]}, {"structured_outputs": {"choice": ["sunny", "rainy"]}}):
        for stream in (False, True):
            content, _, finish = chat(client, server, stream, extra_body=extra, temperature=1.0, seed=5)
            assert finish == "stop" and content in ("sunny", "rainy")


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and c["function"]["name"] in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_choice_required(server, client, ids, stream):
    for seed, temperature in ((0, 0.0), (3, 1.0)):
        content, calls, finish = chat(client, server, stream, tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, seed=seed, temperature=temperature)
        assert content is None and finish == "tool_calls" and len(calls) == 1
        check_calls(calls, {"get_weather", "add"})
    # parallel calls allowed (the default): after each call the model may end or call again; the
    # end-of-sequence token biased up ends after one call, biased away gives calls until max_tokens
    eos = ids["<|im_end|>"]
    content, calls, finish = chat(client, server, stream, tools=TOOLS, tool_choice="required", seed=3,
                                  temperature=1.0, logit_bias={eos: 100})
    assert content is None and finish == "tool_calls" and len(calls) == 1
    check_calls(calls, {"get_weather", "add"})
    content, calls, finish = chat(client, server, stream, tools=TOOLS, tool_choice="required", seed=3,
                                  temperature=1.0, logit_bias={eos: -100}, max_tokens=300)
    assert finish == "length" and len(calls) >= 2 and (content is None or content.lstrip().startswith("<"))
    check_calls(calls, {"get_weather", "add"})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_choice_named_function(server, client, stream):
    for name in ("get_weather", "add"):
        choice = {"type": "function", "function": {"name": name}}
        content, calls, finish = chat(client, server, stream, tools=TOOLS, tool_choice=choice,
                                      parallel_tool_calls=False, seed=1, temperature=1.0)
        assert content is None and finish == "tool_calls" and len(calls) == 1
        check_calls(calls, {name})


def test_structured_output_with_speculation_off_is_the_same(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    on = chat(client, server, False, response_format=fmt, extra_body={"speculative": {"enabled": True}})
    off = chat(client, server, False, response_format=fmt, extra_body={"speculative": {"enabled": False}})
    assert on == off


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}
FMT = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}


@pytest.mark.parametrize("path,body,param,words", [
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type", "'type' must be one of"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "'schema' must be a JSON schema object"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema", "got a string"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a 'json_schema'"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     "response_format", "invalid structured output (json)"),
    ("chat", {"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs", "invalid structured output (json)"),
    ("chat", {"guided_regex": "(("}, "guided_regex", "invalid structured output (regex)"),
    ("completions", {"guided_regex": "[a-"}, "guided_regex", "invalid structured output (regex)"),
    ("completions", {"guided_grammar": "start: nothing_here"}, "guided_grammar", "invalid structured output (grammar)"),
    ("completions", {"guided_json": "{not json"}, "guided_json", "invalid structured output (json)"),
    ("completions", {"guided_choice": []}, "guided_choice", "'choice' must be a non-empty list"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"xml": "a"}}, "structured_outputs", "unknown structured output field"),
    ("completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one output constraint"),
    ("chat", {"response_format": FMT, "guided_regex": "a"}, "response_format", "at most one output constraint"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": FMT}, "tool_choice",
     "at most one output constraint"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not in tools (get_weather, add)"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
              "tool_choice": "required"}, "tool_choice", "invalid structured output (grammar)"),
])
def test_bad_constraints_are_a_400_naming_the_field(server, client, path, body, param, words):
    if path == "chat":
        url, base = "/v1/chat/completions", {"messages": USER}
    else:
        url, base = "/v1/completions", {"prompt": "The quick brown fox"}
    status, err = server.request("POST", url, {"model": server.model, "max_tokens": 5} | base | body)
    assert status == 400 and err["error"]["param"] == param and words in err["error"]["message"], err
    # the server is fine: a good constrained request right after succeeds
    out = client.completions.create(model=server.model, prompt="x", max_tokens=20, temperature=0,
                                    extra_body={"guided_choice": ["ok", "fine"]})
    assert out.choices[0].text in ("ok", "fine")
