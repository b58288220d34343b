"""``draft_context``: the draft model reads exactly the last N tokens of a longer prompt."""
from __future__ import annotations

import pytest
import torch

from conftest import make_model_dir
from specdec import LLM, SamplingParams
from specdec.proposers.draft_model import DraftModelProposer

N = 5


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                   "num_speculative_tokens": 3, "draft_context": N})


def recording(p: DraftModelProposer) -> tuple[list[torch.Tensor], list[int]]:
    """Wrap ``p``'s runner: the logits of its every forward, and how many tokens it prefilled."""
    logits, prefilled = [], []
    fwd, pre = p._logits, p.runner.prefill  # every drafter forward goes through _logits (its head)
    p._logits = lambda *a, **k: (lambda o: logits.append(o.clone()) or o)(fwd(*a, **k))
    p.runner.prefill = lambda row, ids, *a, **k: prefilled.append(len(ids)) or pre(row, ids, *a, **k)
    return logits, prefilled


def test_a_windowed_draft_reads_exactly_the_last_n_prompt_tokens(llm):
    """With ``draft_context`` N, the drafter's logits at every step equal those of the same model fed
    only the last N prompt tokens (its positions re-based to 0), and it prefills those N tokens only.
    Would have caught issue 33, item 1: when the window cut the prompt, ``add`` prefilled the whole
    prompt from slot 0 and later tokens went to ``valid - skip``, over the prompt's own slots, so the
    draft paid the full prefill and read a scrambled context (greedy equality still held: the
    verifier rejected the bad drafts)."""
    model = llm.proposer.runner.model
    windowed, full = DraftModelProposer(model, context=N), DraftModelProposer(model)
    ids = [(7 * i + 3) % 300 + 3 for i in range(20)]
    seqs = [llm.make_sequence(ids, greedy(16)), llm.make_sequence(ids[-(N + 1):], greedy(16))]
    records = []
    for p, s in zip((windowed, full), seqs):
        p.prepare(1, 64)
        s.row = 0
        records.append(recording(p))
        p.add(s)
    for step in range(5):  # draft, keep a varying number of the draft's tokens plus one of "the target's"
        drafts = [p.propose([s], [3]) for p, s in zip((windowed, full), seqs)]
        assert torch.equal(drafts[0].tokens, drafts[1].tokens)
        kept = step % 3
        new = drafts[0].tokens[0, :kept].tolist() + [11 + step]
        for p, s in zip((windowed, full), seqs):
            s.append(new)
            p.on_accept([s], [kept])
    (got, got_prefill), (want, want_prefill) = records
    assert len(got) == len(want) > 5
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    assert got_prefill == want_prefill == [N]  # the window, not the whole prompt


@pytest.mark.parametrize("batch", [1, 3])
def test_windowed_drafts_keep_greedy_output_exact(tiny_model_dir, llm, batch, tmp_path_factory):
    """Greedy output with a cut window equals plain decoding's, alone and batched, on prompts
    longer than the window (a second round reads the draft's own prefix cache)."""
    other = make_model_dir(tmp_path_factory.mktemp("ctx") / "d", layers=1, hidden=32, seed=7)
    spec = LLM(model=str(tiny_model_dir), dtype="float32", progress=False,
               speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 4,
                                   "draft_context": N})
    prompts = [[(5 * i + j) % 250 + 3 for i in range(30 + 7 * j)] for j in range(batch)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(24), num_speculative_tokens=0)]
    for _ in range(2):
        outs = spec.generate(prompts, greedy(24))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def short_context_draft(root, vocab_size: int = 400) -> str:
    """The tiny model with only 64 trained positions (its config lowered after it is written)."""
    import json
    d = make_model_dir(root, vocab_size=vocab_size, seed=1)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 64}))
    return str(d)


@pytest.mark.parametrize("vocab", [400, 300], ids=["same-tokenizer", "other-tokenizer"])
def test_a_draft_reads_at_most_its_trained_positions(tiny_model_dir, tmp_path, vocab):
    """A prompt longer than the draft model's trained positions (64 here) is read through a window of
    its last ``trained_context`` tokens (32), without ``draft_context``: past its positions a draft
    drafts noise (SmolLM2 for a 16k-token prompt: acceptance 0). Greedy output stays plain decoding's."""
    import json
    from specdec.proposers.base import trained_context

    target = tmp_path / "target"
    make_model_dir(target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 4096}))
    draft = short_context_draft(tmp_path / "draft", vocab)
    llm = LLM(model=str(target), dtype="float32", progress=False,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    p = llm.proposer
    assert trained_context(p.runner.model) == 32
    ids = [(7 * i + 3) % 300 + 3 for i in range(100)]
    out = llm.generate(ids, greedy(12))[0]
    assert out.outputs[0].token_ids == llm.generate(ids, greedy(12), num_speculative_tokens=0)[0].outputs[0].token_ids
    seq = llm.make_sequence(ids, greedy(4))
    seq.row = 0
    p.prepare(1, 256)
    p.add(seq)
    if vocab == 400:
        assert p.skip[0] == len(ids) - 1 - 32
    else:
        assert p.rows[0].base > 0 and len(p.rows[0].cached) <= 32
