"""The constraint schema, the compiler's cache, and the masks of a verified block (chains and trees)."""
from __future__ import annotations

import pytest
import torch

from specdec.config import SamplingParams
from specdec.errors import SpecdecError
from specdec.formats.tokenizer import Tokenizer
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


def eos_only(mask: torch.Tensor, tok) -> bool:
    return set(torch.nonzero(mask).flatten().tolist()) == set(tok.eos_token_ids)


def test_every_position_past_the_grammars_end_is_eos_only(compiler, tok):
    """Issue 47, item 3: masks_along masked only one position past the first drafted EOS (none at all
    once the matcher had stopped), so with ignore_eos a verified block let the target emit any token
    where plain decoding is forced to EOS again."""
    m = compiler.matcher(StructuredOutput(choice=["yes", "no"]))
    yes = tok.encode("yes", add_special_tokens=False)
    eos = sorted(tok.eos_token_ids)[0]
    start = legal(m, tok)
    draft = torch.tensor([yes + [eos] * 3])  # the answer, then EOS as ignore_eos decoding goes on
    masks = block_masks([Row(m)], draft, torch.tensor([draft.shape[1]]), None, tok.vocab_size)
    assert all(eos_only(masks[0, j], tok) for j in range(len(yes), draft.shape[1] + 1))
    assert legal(m, tok) == start
    m.consume(yes)  # the grammar is complete: the matcher has stopped
    draft = torch.tensor([[eos, eos, eos]])
    masks = block_masks([Row(m)], draft, torch.tensor([3]), None, tok.vocab_size)
    assert all(eos_only(masks[0, j], tok) for j in range(4))
    # a tree of EOS nodes after the end: every node EOS only too
    masks = block_masks([Row(m)], draft, torch.tensor([3]), torch.tensor([[-1, 0, 1]]), tok.vocab_size)
    assert all(eos_only(masks[0, j], tok) for j in range(4))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_failing_fill_leaves_the_matcher_as_it_was(compiler, tok, tree):
    """Issue 47, item 3: masks_along / mask_after rolled the matcher back only when ``fill`` returned,
    so an exception left it advanced and the request's next kept tokens failed as "grammar rejected"."""
    m = compiler.matcher(StructuredOutput(regex="abc"))
    a, b, c = (tok.encode(s, add_special_tokens=False)[0] for s in "abc")
    start = legal(m, tok)
    real_fill, calls = m.fill, []

    def failing_fill(out):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("mask computation failed")
        real_fill(out)

    m.fill = failing_fill
    parents = torch.tensor([[-1, 0]]) if tree else None
    with pytest.raises(RuntimeError, match="mask computation failed"):
        block_masks([Row(m)], torch.tensor([[a, b]]), torch.tensor([2]), parents, tok.vocab_size)
    del m.fill
    assert legal(m, tok) == start
    m.consume([a, b, c])  # the request goes on from its kept tokens


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from conftest import make_pair

    return make_pair(tmp_path_factory.mktemp("grammar-ignore-eos"))


@pytest.mark.parametrize("method", ["draft_model", "draft_model-tree", "ngram"])
def test_greedy_speculation_with_ignore_eos_equals_plain(pair, method):
    """Issue 47, item 3: with ignore_eos, a grammar that ends early and a drafter of K >= 3, the
    speculative output went on with tokens plain decoding never emits (plain: the answer, then EOS
    to max_tokens; speculative: EOS, EOS, then whatever the unmasked target liked)."""
    from conftest import spec_method_config
    from specdec import LLM

    plain = LLM(model=str(pair[0]), dtype="float32", progress=False)
    spec = LLM(model=str(pair[0]), dtype="float32", progress=False,
               speculative_config=spec_method_config(method, pair[1]) | {"num_speculative_tokens": 4})
    prompts, params = [], []
    for i, so in enumerate([{"choice": ["yes", "no"]}, {"regex": "[0-9]{3}"}] * 2):
        prompts.append(["Hello", "def fibonacci(n):"][i // 2])
        params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, structured_output=so))
    ref = plain.generate(prompts, params)
    outs = spec.generate(prompts, params)
    eos = set(plain.tokenizer.eos_token_ids)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(r.outputs[0].token_ids) == 24 and set(r.outputs[0].token_ids[-8:]) <= eos
    sampled = spec.generate(prompts, [SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=i,
                                                     structured_output=p.structured_output)
                                      for i, p in enumerate(params)])
    for o in sampled:  # sampled: other answers maybe, but after the answer's end only EOS
        ids = o.outputs[0].token_ids
        end = next(i for i, t in enumerate(ids) if t in eos)
        assert set(ids[end:]) <= eos, ids
