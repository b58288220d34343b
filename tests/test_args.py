"""The shared CLI options: sampling flags -> SamplingParams (penalties, logit bias, logprobs)."""
from __future__ import annotations

import argparse

import pytest

from specdec.args import add_sampling_args, sampling_params
from specdec.errors import SpecdecError


def parse(*argv: str):
    p = argparse.ArgumentParser()
    add_sampling_args(p)
    return sampling_params(p.parse_args(list(argv)))


def test_penalty_bias_and_logprobs_flags():
    sp = parse("--presence-penalty", "0.5", "--frequency-penalty", "-1", "--repetition-penalty", "1.2",
               "--logit-bias", "12=-100", "--logit-bias", "7=2.5", "--logprobs", "3")
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sp.logit_bias == {12: -100.0, 7: 2.5} and sp.logprobs == 3 and sp.has_penalties
    off = parse()
    assert not off.has_penalties and off.logit_bias is None and off.logprobs is None


@pytest.mark.parametrize("argv,word", [(("--logit-bias", "x=1"), "TOKEN_ID=BIAS"), (("--logit-bias", "5"), "TOKEN_ID"),
                                       (("--logit-bias", "5=200"), "logit_bias"),
                                       (("--presence-penalty", "9"), "presence_penalty"),
                                       (("--logprobs", "99"), "logprobs")])
def test_bad_flags_are_one_clear_error(argv, word):
    with pytest.raises(SpecdecError, match=word):
        parse(*argv)
