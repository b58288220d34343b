"""Greedy equality with the real Qwen2.5-Coder pair: speculative output is the target's plain greedy
output token for token, for every draft length and batch size."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.tools.bench.speculative import CODE_PROMPTS

pytestmark = pytest.mark.real
SPEC_BENCH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "spec_bench" / "question.jsonl"


def chats(prompts):
    return [[{"role": "user", "content": p}] for p in prompts]


# the bf16 target (asked for: the default runs the GGUF file's own blocks) with an int4 or bf16 draft, and
# the target on the native kernels with the GGUF file's own blocks (speculation is exact relative to the
# quantized target too): (target, draft quantization)
PAIRS = {"int4-draft": ("bf16", "int4"), "bf16-draft": ("bf16", None), "gguf-target": ("gguf", "int4")}
TARGETS = {"bf16": {"dtype": "bfloat16"}, "gguf": {"quantization": "gguf"}}


class Pair:
    """A target with its draft switched in (``set_speculative_config``: the target loads once for both its
    drafts, each draft once), and the target's plain greedy outputs kept per prompt set: they do not depend
    on the draft, so the two bf16 pairs' tests share them."""

    def __init__(self, llm: LLM, plain: dict) -> None:
        self.llm, self.plain = llm, plain

    def want(self, convs, n: int) -> list[list[int]]:
        key = (repr(convs), n)
        if key not in self.plain:
            params = SamplingParams(temperature=0.0, max_tokens=n)
            self.plain[key] = [self.llm.chat(c, params, num_speculative_tokens=0)[0].outputs[0].token_ids for c in convs]
        return self.plain[key]


@pytest.fixture(scope="module")
def targets():
    """{target: (LLM, its plain outputs)}, loaded when first asked for: one per module and worker."""
    return {}


@pytest.fixture
def pair(request, targets):
    """The pair named by the test's (indirect) parameter."""
    target, draft_q = PAIRS[request.param]
    if target not in targets:
        targets[target] = (LLM(model="qwen2.5-coder-1.5b", progress=False, **TARGETS[target]), {})
    llm, plain = targets[target]
    llm.set_speculative_config({"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5, "quantization": draft_q})
    return Pair(llm, plain)


def check(pair: Pair, convs, n: int, ks, batches) -> None:
    """Every draft length K of ``ks`` in every batch size of ``batches`` against plain decoding of
    each prompt alone."""
    check_configs(pair, convs, n, [(k, b) for k in ks for b in batches])


def check_configs(pair: Pair, convs, n: int, configs) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=n)
    want = pair.want(convs, n)
    for k, b in configs:
        for lo in range(0, len(convs), b):
            outs = pair.llm.chat(convs[lo:lo + b], params, num_speculative_tokens=k)
            got = [o.outputs[0].token_ids for o in outs]
            assert got == want[lo:lo + b], f"K={k} batch={b} prompts {lo}..{lo + b - 1}"
            assert sum(o.metrics.num_draft_tokens for o in outs) > 0


# the workers' shares: the code prompts of the bf16 target with both drafts in one worker (one load of the
# target, one plain run of the prompts), the Spec-Bench halves in another (one load); the GGUF target wherever
CODE, MANY = pytest.mark.xdist_group("qwen-bf16-code"), pytest.mark.xdist_group("qwen-bf16-many")


@pytest.mark.parametrize("pair", [pytest.param("int4-draft", marks=[pytest.mark.slow, CODE]),
                                  pytest.param("bf16-draft", marks=[pytest.mark.slow, CODE]),
                                  pytest.param("gguf-target", marks=pytest.mark.slow)], indirect=True)
def test_greedy_equality_code_prompts(pair, request):
    """K=3 for the default pair (K=1, 5 and 8 below), every draft length for the other two pairs: all in
    the slow stage (the module took 1,531 s of the workers on the Xeon with AMX, 2026-12-07, 100 of them
    loading, and three plain runs of the same prompts on the same bf16 target before they were shared)."""
    default = request.node.callspec.params["pair"] == "int4-draft"
    check(pair, chats(CODE_PROMPTS[:4]), 40, ks=(3,) if default else (1, 3, 5, 8), batches=(1, 4))


@pytest.mark.slow
@CODE
@pytest.mark.parametrize("pair", ["int4-draft"], indirect=True)
def test_greedy_equality_code_prompts_other_lengths(pair):
    check(pair, chats(CODE_PROMPTS[:4]), 40, ks=(1, 5, 8), batches=(1, 4))


@pytest.mark.slow
@MANY
@pytest.mark.parametrize("pair", ["int4-draft"], indirect=True)
@pytest.mark.parametrize("half", [0, 1])
def test_greedy_equality_many_prompts(pair, half):
    """One prompt of every Spec-Bench category (the long summarization and RAG ones included), 64
    tokens, the default pair only (the code prompts above cover the others), in two halves that the
    test workers share: K=3 one at a time, and K=8 in batches of 4, which verifies 36 rows, past the 32
    where oneDNN's bf16 product changes kernels on an Intel Xeon (see quant/linear.py)."""
    if not SPEC_BENCH.exists():
        pytest.skip(f"no Spec-Bench questions at {SPEC_BENCH}")
    prompts, seen = [], set()
    for line in SPEC_BENCH.read_text().splitlines():
        rec = json.loads(line)
        if rec["category"] not in seen:
            seen.add(rec["category"])
            prompts.append(rec["turns"][0])
    check_configs(pair, chats(prompts[half::2]), 64, [(3, 1), (8, 4)])
