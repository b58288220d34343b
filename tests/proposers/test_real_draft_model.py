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


@pytest.fixture(scope="module", params=[(None, "int4"), pytest.param((None, None), marks=pytest.mark.slow),
                                        pytest.param(("gguf", "int4"), marks=pytest.mark.slow)],
                ids=["int4-draft", "bf16-draft", "gguf-target"])
def pair(request):
    """The bf16 target with an int4 or bf16 draft, and the target on the native kernels with the
    GGUF file's own blocks (speculation is exact relative to the quantized target too). The default
    pair runs in the default stage; the other two (3.5 minutes on 2 cores) in the slow one."""
    target_q, draft_q = request.param
    return LLM(model="qwen2.5-coder-1.5b", progress=False, quantization=target_q,
               speculative_config={"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5,
                                   "quantization": draft_q})


def check(llm: LLM, convs, n: int, ks, batches) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=n)
    want = [llm.chat(c, params, num_speculative_tokens=0)[0].outputs[0].token_ids for c in convs]
    for k in ks:
        for b in batches:
            for lo in range(0, len(convs), b):
                outs = llm.chat(convs[lo:lo + b], params, num_speculative_tokens=k)
                got = [o.outputs[0].token_ids for o in outs]
                assert got == want[lo:lo + b], f"K={k} batch={b} prompts {lo}..{lo + b - 1}"
                assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_greedy_equality_code_prompts(pair, request):
    """K=3 and 8 for the default pair in the default stage (K=1 and 5 in the slow stage, below)."""
    default = request.node.callspec.id == "int4-draft"
    check(pair, chats(CODE_PROMPTS[:4]), 40, ks=(3, 8) if default else (1, 3, 5, 8), batches=(1, 4))


@pytest.mark.slow
def test_greedy_equality_code_prompts_other_lengths(pair, request):
    if request.node.callspec.id != "int4-draft":
        pytest.skip("the other pairs run every draft length above")
    check(pair, chats(CODE_PROMPTS[:4]), 40, ks=(1, 5), batches=(1, 4))


@pytest.mark.slow
def test_greedy_equality_many_prompts(pair, request):
    """One prompt of every Spec-Bench category too, 128 tokens; the default pair only (the code prompts
    above cover the others): K=8 in a batch of 4 verifies 36 rows, past the 32 where oneDNN's bf16
    product changes kernels on an Intel Xeon (see models/linear.py)."""
    if request.node.callspec.id != "int4-draft":
        pytest.skip("the many-prompts run covers the default pair only (CI time); the code prompts cover all three")
    prompts = list(CODE_PROMPTS[:4])
    if SPEC_BENCH.exists():
        seen = set()
        for line in SPEC_BENCH.read_text().splitlines():
            rec = json.loads(line)
            if rec["category"] not in seen:
                seen.add(rec["category"])
                prompts.append(rec["turns"][0])
    check(pair, chats(prompts), 128, ks=(3, 8), batches=(1, 4))
