"""A draft model of another tokenizer: the byte tables, the shared tokens, and drafts that are accepted.

Losslessness (greedy equality, the sampled law) is the suites' (variant ``draft_model-xvocab``); here
the drafter is the target itself under another numbering of its tokens (``make_xvocab_dir``), so
broken byte tables, a wrong id mapping or a drafter cache out of step with the text show up as drafts
the target rejects; the vocabulary pair is the target's 400 tokens against a 300-token one.
"""
from __future__ import annotations

import pytest

from conftest import make_model_dir, make_xvocab_dir
from specdec import LLM, SamplingParams, SpecdecError
from specdec.formats.tokenizer import Tokenizer
from specdec.formats.vocab_map import VocabPair, clean_text

TEXTS = ["def fibonacci(n):\n    return n", "Hello world! Ünïcödé ✓ 你好 🙂", "<|im_start|>user\nHi<|im_end|>\n"]
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n", "The quick brown fox jumps over", "import os\nimport sys\n\nfor i in"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xvocab")
    target = make_model_dir(root / "target", layers=2, hidden=64, seed=0, scale=4.0)
    return target, make_xvocab_dir(target, root / "drafter", vocab_size=None), make_xvocab_dir(target, root / "x300")


@pytest.fixture(scope="module")
def pair(dirs):
    t, d = Tokenizer(dirs[0]), Tokenizer(dirs[2])
    return VocabPair.build(d.hf, len(d.hf), t.hf, len(t.hf))


def test_token_bytes_spell_the_text(pair):
    for text in TEXTS:
        assert pair.target_text(pair.encode_target(text)) == text.encode()
        assert pair.draft_text(pair.encode_draft(text))[0] == text.encode()


def test_shared_tokens_are_the_same_bytes_under_other_ids(pair):
    d, t = pair.shared_draft.tolist(), pair.shared_target.tolist()
    assert len(set(t)) == len(t) == len(set(d)) > 250  # the 300-token vocabulary lies inside the 400
    assert all(pair.draft_bytes[i] == pair.target_bytes[j] for i, j in zip(d, t))
    assert sum(i != j for i, j in zip(d, t)) > 200  # renumbered: ids differ
    im_end = pair.target_hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in t and pair.draft_bytes[d[t.index(im_end)]] == b"<|im_end|>"  # added tokens by content


def test_clean_text_holds_back_an_unfinished_character():
    data = "a你".encode()
    assert clean_text(data[:2]) == ("a", 1)
    assert clean_text(data) == ("a你", 4)


def test_aligned_finds_a_common_boundary(pair):
    text = "import os\nimport sys\n"
    t, d = pair.encode_target(text), pair.encode_draft(text)
    i, j = pair.aligned(t, d, len(t))
    assert (i, j) == (len(t), len(d))
    i, j = pair.aligned(t, d, 3)
    assert i <= 3 and pair.target_text(t[:i]) == pair.draft_text(d[:j])[0]


def test_sampled_drafts_of_the_target_in_another_vocabulary_are_accepted(dirs):
    """TLI: the drafter is the target's function, its q the target's p wherever the drafter reads the
    target's own tokenization; sampled random-model tokens are often not the canonical tokenization of
    their text (the drafter reads the canonical one), so well under all drafts are accepted (0.28 on
    this seed), while a wrong id mapping (q unrelated to p) accepts next to none."""
    llm = LLM(model=str(dirs[0]), dtype="float32", progress=False,
              speculative_config={"method": "draft_model", "model": str(dirs[1]), "num_speculative_tokens": 4})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=3))
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted / drafted > 0.2, (accepted, drafted)


def proposer_and_seq(dirs, prompt: str):
    import torch

    from specdec.formats.hf import load_model_config, load_state_dict
    from specdec.models.llama import build_model
    from specdec.proposers.cross_vocab import CrossVocabProposer
    from specdec.runtime.sequence import Sequence
    t, d = Tokenizer(dirs[0]), Tokenizer(dirs[2])
    pair = VocabPair.build(d.hf, len(d.hf), t.hf, len(t.hf))
    model = build_model(load_model_config(dirs[2]), load_state_dict(dirs[2], torch.float32), dtype=torch.float32)
    prop = CrossVocabProposer(model, pair, len(t.hf))
    prop.prepare(2, 256)
    seq = Sequence("r", prompt, t.encode(prompt), SamplingParams(temperature=0.0, max_tokens=64), None,
                   frozenset(), 256, torch.Generator(), row=1)
    prop.add(seq)
    return prop, seq, pair, model


def test_a_drafted_text_becomes_the_targets_tokens_of_that_text(dirs):
    prompt, more = "import os\nimport sys\n\nfor i in", " range(10):\n    print(i)"
    prop, seq, pair, _ = proposer_and_seq(dirs, prompt)
    want = pair.encode_target(prompt + more)
    assert want[:seq.num_tokens] == seq.tokens  # a clean boundary: the prompt's tokens lead
    assert prop._to_target(seq, pair.encode_draft(more)) == want[seq.num_tokens:]


def test_the_drafters_cache_follows_the_text_step_after_step(dirs):
    """After drafts and commits of target tokens that do not map 1:1 onto draft tokens, the drafter's
    logits after the synced cache are those of a fresh forward over the draft tokenization."""
    import torch
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
    prop, seq, pair, model = proposer_and_seq(dirs, "def")
    ids = pair.encode_target(text)
    assert ids[:seq.num_tokens] == seq.tokens
    n = seq.num_tokens
    for step in (3, 1, 5, 2, 4, 30, 2):  # commit a few target tokens between drafts
        prop.propose([seq], [4])
        seq.tokens = ids[:n + step]
        n += step
        first, _, ctxs = prop._sync([seq], 4)
        ctx = ctxs[0]
        assert pair.draft_text(ctx)[0] == pair.target_text(seq.tokens)
        fresh = model(torch.tensor([ctx]), torch.arange(len(ctx))[None], model.new_cache(1, len(ctx) + 8)).logits[0, -1]
        torch.testing.assert_close(first[0], fresh, rtol=1e-4, atol=1e-4)


def test_long_prompts_and_draft_context_stay_exact(dirs):
    """A prompt past the frozen-context margin (the drafter freezes and re-tokenizes its tail), and a
    drafter reading only the last 8 prompt tokens."""
    prompt = "import os\nimport sys\n\nfor i in range(10):\n    print(i, os.getcwd(), sys.argv)\n" * 3
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = LLM(model=str(dirs[0]), dtype="float32", progress=False).generate(prompt, params)[0].outputs[0].token_ids
    for extra in ({}, {"draft_context": 8}):
        llm = LLM(model=str(dirs[0]), dtype="float32", progress=False,
                  speculative_config={"method": "draft_model", "model": str(dirs[1]), "num_speculative_tokens": 5} | extra)
        out = llm.generate(prompt, params)[0]
        assert out.outputs[0].token_ids == want
        assert out.metrics.num_draft_tokens > 0


@pytest.mark.parametrize("extra,match", [({"tree_topk": 2}, "another tokenizer"),
                                         ({"draft_vocab_size": 100}, "another tokenizer")])
def test_what_a_cross_vocabulary_drafter_cannot_do_is_a_clear_error(dirs, extra, match):
    with pytest.raises(SpecdecError, match=match):
        LLM(model=str(dirs[0]), dtype="float32", progress=False,
            speculative_config={"method": "draft_model", "model": str(dirs[1])} | extra)


def test_a_cascade_refuses_a_drafter_of_another_tokenizer(dirs):
    with pytest.raises(SpecdecError, match="only the draft_model method drafts across tokenizers"):
        LLM(model=str(dirs[0]), dtype="float32", progress=False,
            speculative_config={"method": "cascade", "model": str(dirs[1])})
