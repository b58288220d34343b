"""Token-tree buffers on tiny arrays, and a tree verified in one step leaving exactly the cache that
decoding its accepted path token by token leaves."""
from __future__ import annotations

import pytest
import torch

from native_util import require_native
from specdec import kernels
from specdec.config import ModelConfig, SamplingParams
from specdec.engine.policies import make_policy
from specdec.engine.step import accept, speculative_step
from specdec.engine.tree import (ancestor_mask, ancestors, branch_tokens, chain_parents, compaction, depths,
                                 normalize_parents, path_order)
from specdec.models.llama import build_model
from specdec.proposers.base import Draft, Proposer
from specdec.models.runner import ModelRunner
from specdec.runtime.sequence import Sequence
from kv_util import same_rows

#      -1 (pending)
#     /    \
#    0      1
#    |     / \
#    2    3   4
#         |
#         5
PARENTS = torch.tensor([[-1, -1, 0, 1, 1, 3]])


def test_ancestors_depths_and_mask():
    anc = ancestors(PARENTS)[0]
    assert anc[5].nonzero().flatten().tolist() == [1, 3, 5]
    assert anc[2].nonzero().flatten().tolist() == [0, 2]
    assert depths(PARENTS).tolist() == [[1, 1, 2, 2, 2, 3]]
    m = ancestor_mask(PARENTS)[0]  # (7, 7): the pending token first
    assert m[:, 0].all() and m[0].nonzero().flatten().tolist() == [0]
    assert m[6].nonzero().flatten().tolist() == [0, 2, 4, 6]
    chain = chain_parents(2, 4)
    assert chain.tolist() == [[-1, 0, 1, 2]] * 2
    assert torch.equal(ancestor_mask(chain)[0], torch.tril(torch.ones(5, 5, dtype=torch.bool)))


def test_normalize_parents_checks_real_nodes_and_roots_padding():
    p = torch.tensor([[-1, 0, 7, 7], [-1, 0, 1, 5]])
    out = normalize_parents(p, torch.tensor([2, 3]))
    assert out.tolist() == [[-1, 0, -1, -1], [-1, 0, 1, -1]]
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        normalize_parents(torch.tensor([[-1, 1]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="node 0 has parent -2"):
        normalize_parents(torch.tensor([[-2]]), torch.tensor([1]))


def test_compaction_moves_only_rows_off_their_chain_slots():
    bs, src, dst = compaction([[1, 3, 5], [0, 1], []], [10, 20, 30])
    assert bs == [0]
    assert src == [[12, 14, 16]] and dst == [[11, 12, 13]]
    bs, src, dst = compaction([[1], [0, 2, 3]], [10, 20])
    assert bs == [0, 1] and src == [[12, 10, 10], [21, 23, 24]] and dst == [[11, 10, 10], [21, 22, 23]]
    assert compaction([[0, 1]], [5]) == ([], [], [])


def test_branch_tokens_and_path_order():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    before = branch_tokens(ids, ancestors(PARENTS))  # (1, 7, 6)
    assert (before[0, 0] == -1).all()
    assert sorted(t for t in before[0, 6].tolist() if t >= 0) == [11, 13, 15]
    assert path_order(torch.tensor([[1, 3, -1]])).tolist() == [[0, 2, 4, 0]]


class _Detok:
    def feed(self, ids):
        return ""

    def flush(self):
        return ""


class FixedTree(Proposer):
    """Proposes the given tree to every row (tokens (B, K), parents (B, K))."""

    def __init__(self, tokens: torch.Tensor, parents: torch.Tensor) -> None:
        self.tokens, self.parents = tokens, parents
        self.paths = None

    def propose(self, seqs, ks):
        return Draft(tokens=self.tokens, num_tokens=torch.full((len(seqs),), self.tokens.shape[1]),
                     parents=self.parents)

    def on_path(self, seqs, paths):
        self.paths = paths


def make_seq(prompt: list[int], row: int) -> Sequence:
    return Sequence(request_id=str(row), prompt=None, prompt_ids=prompt,
                    params=SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), detokenizer=_Detok(),
                    eos_ids=frozenset(), max_len=128, seed=0, row=row)


@pytest.fixture(params=["float32", "bfloat16", "bfloat16-native"])
def model(request, monkeypatch):
    native = request.param.endswith("native")
    if native:
        require_native()  # skips without the kernels; fails under SPECDEC_REQUIRE_KERNELS=1
    else:
        monkeypatch.setenv("SPECDEC_KERNELS", "0")
    kernels.reset()
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, architecture="qwen2",
                      attention_bias=True)
    yield build_model(cfg, dtype=torch.bfloat16 if "bfloat16" in request.param else torch.float32, seed=3)
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    kernels.reset()


def run(model, prompts, proposer, steps, ks):
    runner = ModelRunner(model)
    runner.ensure_cache(len(prompts), 128)
    seqs = [make_seq(p, r) for r, p in enumerate(prompts)]
    for s in seqs:
        runner.prefill(s.row, s.tokens[:-1])
    logits = []
    for _ in range(steps):
        out = speculative_step(runner, proposer, seqs, ks)
        logits.append(out.forward.logits)
        accept(seqs, out, proposer, make_policy(max(ks)))
    return runner, seqs, logits


def test_a_tree_step_leaves_the_cache_of_its_path(model):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (37,), generator=g).tolist(), torch.randint(0, 97, (20,), generator=g).tolist()]
    plain_runner, plain, plain_logits = run(model, prompts, None, 4, [0, 0])
    greedy = [s.output_ids for s in plain]  # 4 tokens per row: the target's own path
    # row 0 accepts nodes 1, 3, 5 (g0, g1, g2) and gets g3 as bonus; row 1 accepts node 0 (g0), then
    # node 2 (its child) is wrong: g1 is recovered. Every other node is a wrong token.
    wrong = [[(t + 1 + j) % 97 for j, t in enumerate(gr)] for gr in greedy]
    tokens = torch.tensor([[wrong[0][0], greedy[0][0], wrong[0][1], greedy[0][1], wrong[0][2], greedy[0][2]],
                           [greedy[1][0], wrong[1][0], wrong[1][1], wrong[1][2], wrong[1][0], wrong[1][3]]])
    prop = FixedTree(tokens, PARENTS.expand(2, -1).clone())
    runner, seqs, logits = run(model, prompts, prop, 1, [6, 6])
    assert prop.paths == [[1, 3, 5], [0]]
    assert seqs[0].output_ids == greedy[0] and seqs[1].output_ids == greedy[1][:2]
    for b, n in ((0, 3), (1, 1)):  # the kept path's keys and values, bit for bit, where a chain puts them
        hi = len(prompts[b]) + n
        assert same_rows(runner.cache, plain_runner.cache, {b: hi})
        for j in range(n + 1):  # the path's logits (read in path order) are the plain steps'
            assert torch.equal(logits[0][b, j], plain_logits[j][b, 0]), (b, j)
    # and decoding goes on from there exactly as plain decoding does
    out = speculative_step(runner, None, seqs, [0, 0])
    accept(seqs, out, None, make_policy(0))
    assert seqs[0].output_ids[4] == plain_tokens_after(model, prompts[0], 5)[4]


def plain_tokens_after(model, prompt, n):
    _, seqs, _ = run(model, [prompt], None, n, [0])
    return seqs[0].output_ids
