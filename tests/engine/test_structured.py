"""Structured output through the engine: every output matches its constraint, and greedy output with
speculation (every method, with and without the grammar-forced draft, mixed batches) is identical to
plain constrained decoding."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import CONSTRAINED_ONLY, EXTRA_TREES, SUITE_VARIANTS, make_pair, spec_method_config
from specdec import LLM, SamplingParams
from specdec.errors import SpecdecError

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
ITEMS = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    "score": {"type": "integer", "minimum": 0, "maximum": 10}},  # a float may run to any length
    "required": ["ok", "tags"], "additionalProperties": False}
CALL = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}
SCHEMAS = [PERSON, ITEMS, CALL]
REGEX = r"[a-h]{1,6} (yes|no)"
LARK = 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/'

PROMPTS = ["Hello", "def fibonacci(n):", "The quick brown", "import os\nimport", "Speculative decoding"]


def constraints() -> list[dict]:
    return [{"json": PERSON}, {"json": ITEMS}, {"json": CALL}, {"regex": REGEX}, {"choice": ["alpha", "beta gamma"]},
            {"grammar": LARK}, {"json_object": True}]


def check(text: str, so: dict) -> None:
    if "json" in so:
        jsonschema.validate(json.loads(text), so["json"])
    elif "json_object" in so:
        assert isinstance(json.loads(text), dict)
    elif "regex" in so:
        assert re.fullmatch(so["regex"], text), text
    elif "choice" in so:
        assert text in so["choice"]
    else:
        assert re.fullmatch(r"x=[0-9]{1,3};", text), text


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def plain(dirs):
    return LLM(model=str(dirs[0]), dtype="float32", progress=False)


def batch(temperature: float) -> tuple[list[str], list[SamplingParams]]:
    """A mixed batch: every constraint and an unconstrained row, over several prompts."""
    prompts, params = [], []
    for i, so in enumerate(constraints() + [None]):
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(temperature=temperature, max_tokens=80, seed=i, structured_output=so))
    return prompts, params


@pytest.fixture(scope="module")
def plain_greedy(plain):
    prompts, params = batch(0.0)
    return plain.generate(prompts, params)


def test_plain_constrained_output_matches_every_constraint(plain_greedy):
    for o, so in zip(plain_greedy, constraints()):
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        check(o.outputs[0].text, so)


def test_fifty_generated_objects_validate_greedy_and_sampled(plain):
    """60 objects from three schemas, across prompts, greedy and sampled at several temperatures."""
    prompts, params = [], []
    for i in range(60):
        prompts.append(PROMPTS[i % len(PROMPTS)] + " " * (i // 15))
        params.append(SamplingParams(temperature=[0.0, 0.7, 1.0, 1.5][i % 4], top_p=0.95, max_tokens=120, seed=i,
                                     structured_output={"json": SCHEMAS[i % 3]}))
    outs = plain.generate(prompts, params)
    for o, p in zip(outs, params):
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), json.loads(p.structured_output.json))


@pytest.mark.parametrize("grammar_draft", [True, False], ids=["forced", "model-only"])
@pytest.mark.parametrize("method", SUITE_VARIANTS + EXTRA_TREES + CONSTRAINED_ONLY)
def test_greedy_speculation_equals_plain_constrained_decoding(dirs, plain_greedy, method, grammar_draft):
    if method == "grammar" and not grammar_draft:
        pytest.skip("the grammar method is the forced draft")
    cfg = spec_method_config(method, dirs[1])
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False,
              speculative_config=cfg | {"num_speculative_tokens": 4, "grammar_draft": grammar_draft})
    prompts, params = batch(0.0)
    outs = llm.generate(prompts, params)
    for o, ref in zip(outs, plain_greedy):
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    sampled = llm.generate(*batch(0.9))  # sampled rows: other draws, but every one legal
    for o, so in zip(sampled, constraints()):
        if o.outputs[0].finish_reason == "length":  # a draw that ran to max_tokens: cut, not illegal
            assert len(o.outputs[0].token_ids) == 80
        else:
            check(o.outputs[0].text, so)


@pytest.mark.parametrize("k", [1, 8])
def test_forced_tokens_alone_are_accepted_whole_and_keep_greedy_output(dirs, plain_greedy, k):
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False,
              speculative_config={"method": "grammar", "num_speculative_tokens": k})
    prompts, params = batch(0.0)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in plain_greedy]
    m = outs[0].metrics  # the person schema: keys, quotes, separators are forced
    assert m.num_draft_tokens > 5 and m.num_accepted_tokens == m.num_draft_tokens


def test_a_grammar_that_cannot_finish_ends_with_length(plain):
    o = plain.generate("Hello", SamplingParams(temperature=0.0, max_tokens=5, structured_output={"json": PERSON}))[0]
    assert o.outputs[0].finish_reason == "length"
    assert o.outputs[0].text.startswith('{"nam')  # the schema's first key, cut off


@pytest.mark.parametrize("so, word", [({"json": {"type": "bogus"}}, "json"), ({"regex": "a(b"}, "regex"),
                                      ({"grammar": "start: undefined_rule"}, "grammar")])
def test_an_invalid_constraint_is_one_clear_error_before_generation(plain, so, word):
    with pytest.raises(SpecdecError, match=f"invalid structured output \\({word}\\)"):
        plain.generate("Hello", SamplingParams(max_tokens=4, structured_output=so))
