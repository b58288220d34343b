"""The trained heads committed beside the embedded models (specdec/heads/<model>/<method>/): within the
size limit, with the record of how they were made, and on the real model loaded by method name alone
(no path, no training), drafting tokens the target keeps, lossless."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec import LLM, SamplingParams

HEADS = Path(__file__).resolve().parents[1] / "specdec" / "heads"
SHIPPED = sorted(p.parent for p in HEADS.glob("*/*/config.json"))
MAX_BYTES = 48 * 1024 * 1024  # the limit per shipped head


def test_every_shipped_head_is_small_and_says_how_it_was_made():
    assert {(p.parent.name, p.name) for p in SHIPPED} >= {("smollm2-135m", "eagle"), ("smollm2-135m", "medusa"),
                                                          ("qwen2.5-coder-1.5b", "medusa")}
    for d in SHIPPED:
        assert (d / "model.safetensors").stat().st_size <= MAX_BYTES, d
        for name in ("data.json", "training.json", "eval.json"):
            json.loads((d / name).read_text())
        assert json.loads((d / "eval.json").read_text())["mean_accepted_length"] > 1.0


@pytest.mark.real
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_a_shipped_head_loads_by_method_name_and_stays_lossless(method):
    llm = LLM(model="smollm2-135m", progress=False, speculative_config={"method": method, "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = "def reverse_words(sentence):\n    \"\"\"Return the words of sentence in reverse order.\"\"\"\n"
    spec = llm.generate(prompt, params)[0]
    plain = llm.generate(prompt, params, num_speculative_tokens=0)[0]
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert spec.metrics.num_accepted_tokens > 0
