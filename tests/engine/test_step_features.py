"""What the verification step adds for requests that ask: raw logprobs (the same with speculation on and
off, the model's own) and penalties that change the output exactly as their definitions say."""
from __future__ import annotations

import pytest
import torch

from conftest import SUITE_VARIANTS, make_pair, spec_method_config
from specdec import LLM, SamplingParams

PROMPTS = ["def fibonacci(n): fibonacci(n):", "The quick brown fox The quick", "Hello", "import os\nimport"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("feat"))


@pytest.fixture(scope="module")
def plain(dirs):
    return LLM(model=str(dirs[0]), dtype="float32", progress=False)


def reference_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) the target's raw logits over the whole sequence, one plain forward."""
    model = llm.target.model
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache(1, len(ids))).logits[0].float()


def reference_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(reference_logits(llm, ids), -1)


PARAMS = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3),
          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, logprobs=0, seed=5),
          SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),  # asks for none
          SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2, frequency_penalty=1.0)]


@pytest.fixture(scope="module")
def plain_logprobs(plain):
    return plain.generate(PROMPTS, PARAMS)


def test_logprobs_are_the_raw_model_logprobs_of_each_token(plain, plain_logprobs):
    for o, p in zip(plain_logprobs, PARAMS):
        lps = o.outputs[0].logprobs
        if p.logprobs is None:
            assert lps is None
            continue
        ids = o.outputs[0].token_ids
        assert [t.token_id for t in lps] == ids and all(len(t.top) == p.logprobs for t in lps)
        ref = reference_logprobs(plain, o.prompt_token_ids + ids)[len(o.prompt_token_ids) - 1:-1]  # (n, V)
        got = torch.tensor([t.logprob for t in lps])
        torch.testing.assert_close(got, ref.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4, rtol=1e-4)
        if p.logprobs:
            assert [[i for i, _ in t.top] for t in lps] == ref.topk(p.logprobs).indices.tolist()


@pytest.mark.parametrize("method", SUITE_VARIANTS)
def test_logprobs_are_identical_with_speculation(dirs, plain, plain_logprobs, method):
    """Greedy rows: the same tokens and, bit for bit, the same logprobs (from the verification forward).
    The sampled row draws other tokens than plain decoding (same law, other draws): its logprobs are
    the raw model's of the tokens it drew."""
    cfg = spec_method_config(method, dirs[1]) | {"num_speculative_tokens": 4}
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False, speculative_config=cfg)
    outs = llm.generate(PROMPTS, PARAMS)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    for o, ref, p in zip(outs, plain_logprobs, PARAMS):
        if p.greedy:
            assert o.outputs[0].token_ids == ref.outputs[0].token_ids
            assert o.outputs[0].logprobs == ref.outputs[0].logprobs
        else:
            ids = o.outputs[0].token_ids
            want = reference_logprobs(plain, o.prompt_token_ids + ids)[len(o.prompt_token_ids) - 1:-1]
            got = torch.tensor([t.logprob for t in o.outputs[0].logprobs])
            torch.testing.assert_close(got, want.gather(1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4, rtol=1e-4)


def test_prompt_logprobs_only_for_the_requests_that_ask(plain):
    p = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2)
    asked, other = plain.generate(["The quick brown fox", "Hello"], [p, p.replace(prompt_logprobs=None)])
    ids = asked.prompt_token_ids
    assert other.prompt_logprobs is None and asked.prompt_logprobs[0] is None
    lps = asked.prompt_logprobs[1:]
    assert [t.token_id for t in lps] == ids[1:] and all(len(t.top) == 2 for t in lps)
    ref = reference_logprobs(plain, ids)[:-1]
    got = torch.tensor([t.logprob for t in lps])
    torch.testing.assert_close(got, ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-4, rtol=1e-4)


def test_penalties_change_greedy_output_exactly_as_defined(plain):
    """Each greedy token is the argmax of the raw logits after the definitions' arithmetic (recomputed
    here from a plain forward), and the penalties really break the model's repetition."""
    prompt = "The quick brown fox The quick brown fox The quick"
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    loop = plain.generate(prompt, base)[0]
    pen = base.replace(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0)
    out = plain.generate(prompt, pen)[0]
    repeated = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeated(out.outputs[0].token_ids) < repeated(loop.outputs[0].token_ids)
    ids, gen = out.prompt_token_ids, out.outputs[0].token_ids
    raw = reference_logits(plain, ids + gen)
    for t, tok in enumerate(gen):
        x = raw[len(ids) - 1 + t].clone()
        before = gen[:t]
        for v in set(ids) | set(before):
            x[v] = x[v] / 2.0 if x[v] > 0 else x[v] * 2.0
        for v in set(before):
            x[v] -= 2.0 * before.count(v) + 2.0
        assert int(x.argmax()) == tok, t
    banned = loop.outputs[0].token_ids[0]
    again = plain.generate(prompt, base.replace(logit_bias={banned: -100.0}))[0].outputs[0].token_ids
    assert banned not in again


@pytest.mark.real
def test_real_model_penalties_and_logprobs_with_speculation():
    """SmolLM2-135M with its own int4 self-draft: penalized greedy output and its logprobs equal plain
    decoding's, and a frequency penalty breaks a repetition the model makes without it."""
    llm = LLM(model="smollm2-135m", progress=False,
              speculative_config={"method": "layer_skip", "quantization": "int4", "num_speculative_tokens": 4})
    msgs = [{"role": "user", "content": "Repeat the word 'cat' twenty times, separated by spaces."}]
    base = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    pen = base.replace(frequency_penalty=1.5, presence_penalty=0.5)
    for p in (base, pen):
        plain = llm.chat(msgs, p, num_speculative_tokens=0)[0]
        spec = llm.chat(msgs, p)[0]
        assert spec.outputs[0].token_ids == plain.outputs[0].token_ids and spec.metrics.num_accepted_tokens > 0
        assert spec.outputs[0].logprobs == plain.outputs[0].logprobs
    repeated = [llm.chat(msgs, p)[0].outputs[0].text.lower().count("cat") for p in (base, pen)]
    assert repeated[1] < repeated[0]
