"""Penalties and logit bias: OpenAI's / vLLM's definitions, and the per-position counts of a block."""
from __future__ import annotations

import pytest
import torch

from specdec.config import SamplingParams
from specdec.errors import SpecdecError
from specdec.runtime.sequence import Sequence
from specdec.sampling.penalties import Penalties

V = 12


def seq(prompt: list[int], output: list[int], **kw) -> Sequence:
    return Sequence(request_id="r", prompt=None, prompt_ids=prompt, params=SamplingParams(**kw), detokenizer=None,
                    eos_ids=frozenset(), max_len=100, seed=0, output_ids=output)


def reference(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """The definitions, token by token: bias; vLLM's repetition penalty over prompt + output;
    OpenAI's mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence over the output."""
    x = logits.clone().double()
    for v in range(V):
        x[v] += (p.logit_bias or {}).get(v, 0.0)
        c = output.count(v)
        if v in prompt or c > 0:
            x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
        x[v] -= c * p.frequency_penalty + (c > 0) * p.presence_penalty
    return x.float()


KW = [dict(presence_penalty=0.7), dict(frequency_penalty=-0.4), dict(repetition_penalty=1.8),
      dict(repetition_penalty=0.6), dict(logit_bias={3: 5.0, 7: -100.0}),
      dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={0: 2.0, 9: -1.0})]


@pytest.mark.parametrize("kw", KW, ids=[str(k) for k in KW])
def test_each_penalty_matches_its_definition(kw):
    torch.manual_seed(0)
    prompt, output = [1, 2, 2, 5], [3, 3, 4, 1, 3]
    s = seq(prompt, output, **kw)
    logits = torch.randn(1, V) * 3
    got = Penalties.from_seqs([s]).apply(logits)[0]
    torch.testing.assert_close(got, reference(logits[0], prompt, output, s.params), rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, logits[0])  # each setting really changes something


def test_a_verified_block_counts_the_drafts_before_each_position():
    """Position t of a block scores exactly what plain decoding scores after drafts[:t] (bit for bit)."""
    torch.manual_seed(1)
    kw = dict(presence_penalty=0.9, frequency_penalty=0.6, repetition_penalty=1.4, logit_bias={2: 1.0})
    seqs = [seq([1, 2], [3], **kw), seq([4], [], **kw), seq([5, 6], [6])]  # the last row has no penalty
    drafts = torch.tensor([[3, 7, 3], [4, 4, -1], [1, 1, 1]])  # -1: padding
    logits = torch.randn(3, 4, V)
    block = Penalties.from_seqs(seqs).apply(logits, drafts)  # (B, 4, V)
    assert torch.equal(block[2], logits[2])  # untouched row
    for b in range(2):
        for t in range(4):
            d = [x for x in drafts[b, :t].tolist() if x >= 0]
            plain = seq(seqs[b].prompt_ids, seqs[b].output_ids + d, **kw)
            assert torch.equal(block[b, t], Penalties.from_seqs([plain]).apply(logits[b:b + 1, t])[0]), (b, t)


def test_a_drafter_position_counts_everything_drafted_so_far():
    torch.manual_seed(2)
    s = seq([1], [2], frequency_penalty=1.0)
    logits = torch.randn(1, V)
    got = Penalties.from_seqs([s]).apply(logits, torch.tensor([[2, 5]]))[0]
    want = Penalties.from_seqs([seq([1], [2, 2, 5], frequency_penalty=1.0)]).apply(logits)[0]
    assert torch.equal(got, want)


def test_no_penalty_is_free_and_ids_past_a_smaller_vocabulary_are_skipped():
    assert Penalties.from_seqs([seq([1], [2]), seq([3], [])]) is None
    s = seq([1], [2], logit_bias={V + 5: 3.0, 2: 1.0})
    got = Penalties.from_seqs([s]).apply(torch.zeros(1, V))
    assert got[0, 2] == 1.0 and got.sum() == 1.0


@pytest.mark.parametrize("kw,word", [(dict(presence_penalty=2.5), "presence_penalty"),
                                     (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                                     (dict(repetition_penalty=0.0), "repetition_penalty"),
                                     (dict(logit_bias={1: 101.0}), "logit_bias"),
                                     (dict(logit_bias={-1: 1.0}), "logit_bias"),
                                     (dict(logit_bias={"x": 1.0}), "logit_bias"),
                                     (dict(logprobs=21), "logprobs"),
                                     (dict(prompt_logprobs=-1), "prompt_logprobs")])
def test_bad_values_are_one_clear_error(kw, word):
    with pytest.raises(SpecdecError, match=word):
        SamplingParams(**kw)


def test_logit_bias_keys_from_json_become_ints():
    assert SamplingParams(logit_bias={"12": 3}).logit_bias == {12: 3.0}
    assert not SamplingParams(logit_bias={}).has_penalties
