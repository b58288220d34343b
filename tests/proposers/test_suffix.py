"""Suffix-tree drafting: the tries and the frequency-scored tree on tiny token lists, and the shared
trie learning from finished requests (greedy equality and the sampled law: the shared suites)."""
from __future__ import annotations

import torch

from specdec.config import SamplingParams
from specdec.proposers.suffix import SuffixProposer, SuffixTrie, grow_tree
from specdec.runtime.sequence import Sequence


def test_trie_counts_substrings_up_to_its_depth():
    t = SuffixTrie(depth=3)
    t.extend([1, 2, 3, 1, 2, 4])
    assert t.root.children[1].count == 2 and t.root.children[1].children[2].count == 2
    assert set(t.root.children[1].children[2].children) == {3, 4}
    assert not t.root.children[1].children[2].children[3].children  # depth 3: no deeper
    node, n = t.match_end()  # the text ends "... 2 4": "4" never occurred before, "2 4" neither
    assert node is None and n == 0
    t.extend([1, 2])  # now it ends "1 2", seen twice before, followed by 3 and by 4
    node, n = t.match_end()
    assert n == 2 and set(node.children) == {3, 4}


def test_match_finds_the_longest_known_suffix_of_any_context():
    t = SuffixTrie(depth=4)
    t.extend([5, 6, 7, 8])
    t.end()
    t.extend([9, 6, 7, 1])
    node, n = t.match([0, 5, 6, 7])
    assert n == 3 and set(node.children) == {8}
    node, n = t.match([0, 0, 6, 7])
    assert n == 2 and set(node.children) == {8, 1}
    assert t.match([3, 3]) == (None, 0)


def test_grow_tree_is_best_first_by_branch_probability():
    t = SuffixTrie(depth=4)
    for text in ([1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 4, 5]):
        t.extend(text)
        t.end()
    node, _ = t.match([1])
    tokens, parents, score = grow_tree(node, size=3, min_prob=0.0)
    assert tokens == [2, 3, 4] and parents == [-1, 0, -1]  # 2 (0.75), its child 3 (0.75), then 4 (0.25)
    assert abs(score - 1.75) < 1e-9
    tokens, parents, _ = grow_tree(node, size=8, min_prob=0.5)
    assert tokens == [2, 3]  # 4 and 5 fall under min_prob


class _Detok:
    def feed(self, ids):
        return ""

    def flush(self):
        return ""


def seq(rid: str, prompt: list[int], out: list[int] = ()) -> Sequence:
    return Sequence(request_id=rid, prompt=None, prompt_ids=prompt, output_ids=list(out),
                    params=SamplingParams(temperature=0.0, max_tokens=50), detokenizer=_Detok(), eos_ids=frozenset(),
                    max_len=200, seed=0)


def test_proposer_drafts_from_the_request_and_from_past_outputs():
    prop = SuffixProposer(depth=8, factor=4.0, min_prob=0.0, cache_tokens=100)
    a = seq("a", [1, 2, 3, 4, 1, 2])
    prop.add(a)
    d = prop.propose([a], [5])
    assert d.parents is not None and d.tokens[0, :d.num_tokens[0]].tolist()[:2] == [3, 4]
    # a finished request's output teaches the shared trie: a new request continues it
    done = seq("b", [7], [20, 21, 22, 23, 24])
    prop.add(done)
    prop.remove(done)
    c = seq("c", [9, 9, 20, 21])
    prop.add(c)
    d = prop.propose([c], [3])
    assert d.tokens[0, :3].tolist() == [22, 23, 24] and d.parents[0, :3].tolist() == [-1, 0, 1]
    # memory stays bounded: old outputs leave the shared trie
    for i in range(30):
        s = seq(f"x{i}", [7], list(range(100 + 10 * i, 110 + 10 * i)))
        prop.add(s)
        prop.remove(s)
    assert prop.past_tokens <= 100 and 20 not in prop.shared.root.children


def test_a_long_match_leaves_room_for_the_draft():
    # a trie of depth 6 holds continuations at most 6 - n tokens below a match of n tokens: the longest
    # match ("1 2 3 4 5") would leave one; the proposer matches short enough to draft all k
    prop = SuffixProposer(depth=6, factor=8.0, min_prob=0.0, cache_tokens=0)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5])
    prop.add(a)
    d = prop.propose([a], [4])
    assert d.tokens[0, :d.num_tokens[0]].tolist() == [6, 7, 8, 1]
    trie, _ = prop.local["a"]
    node, n = trie.match_end()
    assert n == 5 and list(node.children) == [6] and not node.children[6].children
