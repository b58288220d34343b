"""The constraint schema, the compiler's cache, and the masks of a verified block (chains and trees)."""
from __future__ import annotations

import pytest
import torch

from specdec.config import SamplingParams
from specdec.errors import SpecdecError
from specdec.models.tokenizer import Tokenizer
from specdec.sampling.grammar import DraftMasks, GrammarCompiler, StructuredOutput, block_masks, unpack


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, tok.vocab_size)


class Row:
    """What block_masks reads of a sequence."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher


def legal(m, tok) -> set[int]:
    bits = torch.zeros(m.words, dtype=torch.int32)
    m.fill(bits)
    return set(torch.nonzero(unpack(bits, tok.vocab_size)).flatten().tolist())


@pytest.mark.parametrize("kw, word", [({}, "got none"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
                                      ({"choice": []}, "non-empty list"), ({"regex": 3}, "non-empty string"),
                                      ({"json": 3}, "JSON schema object")])
def test_a_constraint_takes_exactly_one_well_typed_kind(kw, word):
    with pytest.raises(SpecdecError, match=word):
        StructuredOutput(**kw)


def test_sampling_params_take_the_dict_and_name_unknown_fields():
    p = SamplingParams(structured_output={"json": {"type": "object"}})
    assert p.structured_output.kind == "json" and p.structured_output.json == '{"type": "object"}'
    with pytest.raises(SpecdecError, match="unknown structured output field.*jsonschema"):
        SamplingParams(structured_output={"jsonschema": {}})


def test_compiled_grammars_are_cached(compiler):
    so = StructuredOutput(regex="[a-c]+")
    before = compiler.misses
    compiler.matcher(so)
    compiler.matcher(StructuredOutput(regex="[a-c]+"))
    assert compiler.misses == before + 1 and compiler.hits >= 1


def test_choice_strings_are_literals_not_patterns(compiler, tok):
    m = compiler.matcher(StructuredOutput(choice=['a.b', 'say "hi"\n']))
    dot = tok.encode("a", add_special_tokens=False) + tok.encode("x", add_special_tokens=False)
    assert m.m.validate_tokens(dot) < len(dot)  # "." is not any character
    ok = tok.encode('say "hi"\n', add_special_tokens=False)
    assert m.m.validate_tokens(ok) == len(ok)


def test_block_masks_follow_the_draft_and_leave_the_matcher_as_it_was(compiler, tok):
    m = compiler.matcher(StructuredOutput(regex="ab(c|d)"))
    a, b, c, x = (tok.encode(s, add_special_tokens=False)[0] for s in "abcx")
    eos = sorted(tok.eos_token_ids)[0]
    start = legal(m, tok)
    draft = torch.tensor([[a, b, x, c], [a, b, c, eos]])
    masks = block_masks([Row(m), Row(None)], draft[:1].expand(2, 4), torch.tensor([4, 4]), None, tok.vocab_size)
    assert masks.shape == (2, 5, tok.vocab_size) and bool(masks[1].all())  # unconstrained row: all legal
    assert bool(masks[0, 0, a]) and not bool(masks[0, 0, b])
    assert bool(masks[0, 2, c]) and not bool(masks[0, 2, x])  # after "ab": c or d
    assert bool(masks[0, 3:].all())  # past the first illegal token: never reached
    assert legal(m, tok) == start
    # an EOS inside the draft is not consumed (no roll back over a stop); after it, only EOS again
    masks = block_masks([Row(m)], draft[1:], torch.tensor([4]), None, tok.vocab_size)
    assert set(torch.nonzero(masks[0, 3]).flatten().tolist()) >= {eos}
    assert set(torch.nonzero(masks[0, 4]).flatten().tolist()) == set(tok.eos_token_ids)
    assert legal(m, tok) == start


def test_tree_masks_follow_each_nodes_ancestors(compiler, tok):
    m = compiler.matcher(StructuredOutput(regex="(ab|ba)c"))
    a, b, c = (tok.encode(s, add_special_tokens=False)[0] for s in "abc")
    # node 0: a, node 1: b (sibling), node 2: b under a, node 3: a under b, node 4: c under ab
    tokens, parents = torch.tensor([[a, b, b, a, c]]), torch.tensor([[-1, -1, 0, 1, 2]])
    masks = block_masks([Row(m)], tokens, torch.tensor([5]), parents, tok.vocab_size)
    assert bool(masks[0, 1, b]) and not bool(masks[0, 1, a])  # after a: b
    # after b: a (where the rest is forced, llguidance allows the canonical token of the forced text only)
    after_b = torch.nonzero(masks[0, 2]).flatten().tolist()
    assert after_b and all(tok.decode([t]) in ("a", "ac") for t in after_b)
    assert bool(masks[0, 3, c])  # after ab: c
    assert set(torch.nonzero(masks[0, 5]).flatten().tolist()) == set(tok.eos_token_ids)  # after abc: the end


def test_draft_masks_advance_and_roll_back(compiler, tok):
    m = compiler.matcher(StructuredOutput(regex="abc"))
    a, b = (tok.encode(s, add_special_tokens=False)[0] for s in "ab")
    start = legal(m, tok)
    dm = DraftMasks([Row(m)])
    logits = torch.zeros(1, tok.vocab_size)
    assert torch.isfinite(dm.apply(logits)[0]).nonzero().flatten().tolist() == [a]
    dm.advance(torch.tensor([a]))
    assert torch.isfinite(dm.apply(logits)[0]).nonzero().flatten().tolist() == [b]
    dm.release()
    assert legal(m, tok) == start


def test_forced_tokens_are_the_grammars_only_continuation(compiler, tok):
    m = compiler.matcher(StructuredOutput(json='{"type": "object", "properties": {"name": {"type": "string"}}, '
                                               '"required": ["name"], "additionalProperties": false}'))
    assert tok.decode(m.forced(32)).startswith('{"name":')
    assert len(m.forced(2)) == 2 and m.forced(0) == []


def test_gbnf_grammars_are_converted(compiler, tok):
    m = compiler.matcher(StructuredOutput(grammar='root ::= "x=" [0-9] [0-9]? ";"'))
    ok, bad = (tok.encode(t, add_special_tokens=False) for t in ("x=42;", "x=;"))
    assert m.m.validate_tokens(ok) == len(ok) and m.m.validate_tokens(bad) < len(bad)
    with pytest.raises(SpecdecError, match=r"invalid structured output \(grammar\)"):
        compiler.matcher(StructuredOutput(grammar="root ::= ( unclosed"))
