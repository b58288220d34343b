"""Every OpenAI request feature with speculation on, through the official openai client: logprobs
(equal with speculation on and off), echo, penalties and logit_bias, harmless extra fields, and a
two-turn tool-calling conversation (streamed and not; the tiny model's replies to the tool turns are
canned by tests/server/forced_serve.py), also through LangChain's ChatOpenAI."""
from __future__ import annotations

import json

import pytest

from server_util import KEY, ROOT, ServerProcess, chat_choice, spec, templated_model

openai = pytest.importorskip("openai")

# a Qwen2.5-like template: tools in the system turn, <tool_call> JSON, tool results as <tool_response>
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t | tojson }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 22 degrees in Paris."
# turn 2 is recognised only if the assistant's call (arguments as an object) and the tool's result
# went through the template
TURN2 = ('{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|><|im_start|>user\n'
         '<tool_response>{"temperature": 22}</tool_response>')
FORCED = [[TURN2, ANSWER], ['"name": "get_weather"', CALL_TEXT]]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = templated_model(tmp_path_factory.mktemp("feat"), TOOLS_TEMPLATE, 2048)
    srv = ServerProcess(model, "--speculative-model", str(model), "--num-speculative-tokens", "4", api_key=KEY,
                        module="forced_serve", env={"SPECDEC_FORCED": json.dumps(FORCED),
                                                    "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'server'}"})
    yield srv
    srv.stop()


def chat_logprobs(client, server, on: bool, stream: bool, **kw):
    args = dict(model=server.model, messages=[{"role": "user", "content": "The quick brown fox"}], temperature=0,
                max_tokens=20, logprobs=True, top_logprobs=3, extra_body=spec(on)) | kw
    if not stream:
        out = client.chat.completions.create(**args)
        return out.choices[0].message.content, [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                                                for t in out.choices[0].logprobs.content]
    text, lps = "", []
    for c in client.chat.completions.create(stream=True, **args):
        if c.choices:
            text += c.choices[0].delta.content or ""
            if c.choices[0].logprobs is not None:
                lps += [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                        for t in c.choices[0].logprobs.content]
    return text, lps


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_are_equal_with_speculation_on_and_off(server, client, stream):
    off, on = chat_logprobs(client, server, False, stream), chat_logprobs(client, server, True, stream)
    assert off == on and len(on[1]) == 20 and all(len(top) == 3 for _, _, top in on[1])
    assert all(lp <= 0 and top[0][1] >= lp for _, lp, top in on[1])
    assert chat_logprobs(client, server, True, not stream) == on  # streamed == whole


def test_completion_logprobs_and_echo(server, client):
    args = dict(model=server.model, prompt="def fibonacci(n):", max_tokens=12, temperature=0, logprobs=2)
    off = client.completions.create(**args, extra_body=spec(False)).choices[0]
    on = client.completions.create(**args, extra_body=spec(True)).choices[0]
    assert on.text == off.text and on.logprobs.model_dump() == off.logprobs.model_dump()
    # chosen + top 2 by token string (partial UTF-8 pieces all decode to U+FFFD, so they may merge)
    assert len(on.logprobs.tokens) == 12 and all(1 <= len(t) <= 3 for t in on.logprobs.top_logprobs)
    echo = client.completions.create(**args, echo=True, extra_body=spec(True)).choices[0]
    assert echo.text == "def fibonacci(n):" + on.text
    n_prompt = len(echo.logprobs.tokens) - 12
    assert echo.logprobs.token_logprobs[0] is None and all(v is not None for v in echo.logprobs.token_logprobs[1:])
    assert echo.logprobs.token_logprobs[n_prompt:] == on.logprobs.token_logprobs
    chunks = list(client.completions.create(**args, echo=True, stream=True, extra_body=spec(True)))
    assert "".join(c.choices[0].text for c in chunks) == echo.text
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == echo.logprobs.token_logprobs


def test_penalties_and_bias_keep_greedy_equality_and_change_the_output(server, client):
    args = dict(model=server.model, prompt="The quick brown fox The quick brown fox", max_tokens=24, temperature=0)
    plain = client.completions.create(**args, extra_body=spec(False)).choices[0].text
    pen = dict(presence_penalty=1.5, frequency_penalty=1.0, logit_bias={"5": 4.0})
    extra = {"repetition_penalty": 1.5}
    off = client.completions.create(**args, **pen, extra_body=spec(False) | extra).choices[0].text
    on = client.completions.create(**args, **pen, extra_body=spec(True) | extra).choices[0].text
    assert on == off != plain


@pytest.mark.parametrize("field,value", [("metadata", {"k": "v"}), ("store", False), ("service_tier", "auto"),
                                         ("user", "u1"), ("parallel_tool_calls", True)])
def test_harmless_fields_are_accepted(server, client, field, value):
    out = client.chat.completions.create(model=server.model, messages=USER, max_tokens=3, **{field: value})
    assert out.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("body,word", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"functions": []}, "functions"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, body, word):
    status, err = server.request("POST", "/v1/chat/completions", {"model": server.model, "messages": USER} | body)
    assert status == 400 and err["error"]["param"].startswith(word), err


def call_turn(client, server, stream: bool, messages: list[dict]) -> tuple[str | None, list[dict], str]:
    return chat_choice(client, model=server.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=200,
                       stream=stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_two_turn_tool_conversation(server, client, stream):
    content, calls, finish = call_turn(client, server, stream, USER)
    assert content is None and finish == "tool_calls" and len(calls) == 1
    call = calls[0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 22}'}]
    content, calls, finish = call_turn(client, server, stream, history)
    assert (content, calls, finish) == (ANSWER, [], "stop")


def test_tool_choice_none_shows_no_tools_and_parses_no_calls(server, client):
    out = client.chat.completions.create(model=server.model, messages=USER, tools=TOOLS, tool_choice="none",
                                         max_tokens=5, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"


def test_langchain_chat_openai_round_trip(server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city"""
        return '{"temperature": 22}'

    llm = lc.ChatOpenAI(model=server.model, base_url=server.url + "/v1", api_key=KEY, temperature=0, max_tokens=200,
                        max_retries=0).bind_tools([get_weather])
    msgs = [HumanMessage("Weather in Paris?")]
    ai = llm.invoke(msgs)
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris"})]
    msgs += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    assert llm.invoke(msgs).content == ANSWER
