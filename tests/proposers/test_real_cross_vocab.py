"""The real pair of different vocabularies: SmolLM2-135M (49,152 tokens) drafting for Qwen2.5-Coder-0.5B
(151,936): greedy output is the target's plain greedy output, and its drafts are accepted; sampled
rows draft through the token-level intersection and get drafts accepted too."""
from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams
from specdec.tools.bench.speculative import CODE_PROMPTS

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def llm():
    return LLM(model="qwen2.5-coder-0.5b", progress=False,
               speculative_config={"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 4})


def chats(prompts):
    return [[{"role": "user", "content": p}] for p in prompts]


def test_greedy_equality_and_acceptance(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    convs = chats(CODE_PROMPTS[:2] + ["Say hello in Chinese and in Japanese, with an emoji."])
    want = [llm.chat(c, params, num_speculative_tokens=0)[0].outputs[0].token_ids for c in convs]
    outs = llm.chat(convs, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted / drafted > 0.2, (accepted, drafted)


@pytest.mark.slow  # 14 s; the greedy cross-vocabulary test above stays in the default run
def test_sampled_rows_draft_through_the_intersection(llm):
    params = SamplingParams(temperature=0.7, max_tokens=40, seed=0)
    outs = llm.chat(chats(CODE_PROMPTS[:2]), params)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.metrics.num_accepted_tokens for o in outs) > 0.2 * drafted
