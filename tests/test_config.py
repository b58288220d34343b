"""SamplingParams validation: one clear error for bad values; tiny temperatures are greedy (as in vLLM)."""
from __future__ import annotations

import math

import pytest

from specdec.config import SamplingParams
from specdec.errors import SpecdecError


@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1, 7.0])
def test_seeds_in_range_are_kept_as_ints(seed):
    p = SamplingParams(seed=seed)
    assert p.seed == int(seed) and isinstance(p.seed, int)


@pytest.mark.parametrize("seed", [2**64, 2**70, 1180591620717411303424, -1, 1.5, math.nan, math.inf, "3", True])
def test_seeds_out_of_range_get_one_clear_error(seed):
    with pytest.raises(SpecdecError) as e:
        SamplingParams(seed=seed)
    msg = str(e.value)
    assert "seed must be an integer in [0, 2**64)" in msg and "\n" not in msg


@pytest.mark.parametrize("t", [1e-40, 1e-6, 9.99e-6, 5e-324])
def test_tiny_temperatures_are_greedy(t):
    p = SamplingParams(temperature=t)
    assert p.temperature == 0.0 and p.greedy


@pytest.mark.parametrize("t", [1e-5, 0.5, 1.0, 7.0])
def test_other_temperatures_sample(t):
    p = SamplingParams(temperature=t)
    assert p.temperature == t and not p.greedy


@pytest.mark.parametrize("kw,needle", [
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
    ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
    ({"temperature": "hot"}, "temperature must be a finite number >= 0"),
    ({"top_k": math.nan}, "top_k must be -1"),
    ({"max_tokens": math.inf}, "max_tokens must be a positive integer"),
    ({"max_tokens": "10"}, "must be numbers"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
])
def test_bad_values_get_one_line_errors(kw, needle):
    with pytest.raises(SpecdecError) as e:
        SamplingParams(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["²", "١٢", "٣", pytest.param("1" * 5000, id="5000-digits"), "-1", "1.5", "", " "])
def test_logit_bias_keys_that_are_not_ascii_token_ids_get_one_clear_error(key):
    """Issue 47, item 5: the key check was ``str.isdigit`` then ``int``: "²" is a digit to isdigit and
    int refuses it (a ValueError, a 500 from the server), "١٢" was read as token 12, and a key of 5,000
    digits is past int's limit on strings."""
    with pytest.raises(SpecdecError, match="logit_bias must map token ids"):
        SamplingParams(logit_bias={key: 1.0})


def test_logit_bias_string_keys_of_ascii_digits_are_token_ids():
    assert SamplingParams(logit_bias={"12": 1, " 7 ": -2.5, 3: 0.5}).logit_bias == {12: 1.0, 7: -2.5, 3: 0.5}
