"""A hybrid model's state rings (``HybridCache``): widened once a cache exists, and a failed widening leaves
the model and its cache as they were."""
from __future__ import annotations

import pytest
import torch

from family_util import family_config, family_dir
from specdec import LLM, SamplingParams
from specdec.models.llama import build_model
from specdec.runtime.state_cache import slots_for

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "The quick brown fox jumps over the lazy dog."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_rings_grow_after_a_plain_generate_and_speculation_stays_exact(tmp_path):
    """Catches the resize that copied ``held[:, :0]`` of the old width into the new one (a shape error
    once a cache exists): LFM2, plain generate, then n-gram K = 8 (wider rings) gives plain greedy's
    tokens, and the model's ring width follows the cache's."""
    llm = LLM(model=str(family_dir(tmp_path, "lfm2")), dtype="float32", progress=False)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.set_speculative_config({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1})
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    model, cache = llm.target.model, llm.runner.cache
    assert cache.slots == model.state_slots == slots_for(9, model.config.conv_kernel)
    assert cache.inputs[0].shape[1] == cache.held.shape[2] == cache.slots


def test_rings_cannot_grow_under_a_running_request_and_the_model_keeps_its_width():
    """Catches the width bumped on the model before its cache refused to grow: the refusal leaves both
    the model's ``state_slots`` and the cache as they were, so the next cache is not sized differently."""
    model = build_model(family_config("lfm2"), dtype=torch.float32)
    cache = model.new_cache(2, 64)
    with torch.no_grad():
        model(torch.ones(1, 5, dtype=torch.long), torch.arange(5)[None], cache, rows=torch.tensor([0]))
    before = model.state_slots
    with pytest.raises(RuntimeError, match="only grow while no request runs"):
        model.fit_state_slots(before + 4, cache)
    assert model.state_slots == cache.slots == before
    cache.free(0)
    model.fit_state_slots(before + 4, cache)
    assert model.state_slots == cache.slots == slots_for(before + 4, model.config.conv_kernel)
