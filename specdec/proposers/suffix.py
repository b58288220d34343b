"""Suffix-tree drafting (Oliaro et al. 2025, "SuffixDecoding: Extreme Speculative Decoding for
Emerging AI Applications"; vLLM's ``method: suffix`` on ArcticInference): no model, a token tree.

Two tries of bounded depth count every substring seen: one per request over its prompt and output
so far, and one shared by every request over the outputs of past requests (bounded: the oldest
outputs are dropped past ``suffix_cache_tokens``). Each step the longest suffix of the sequence
that occurred before with a continuation is found in each trie, at most ``suffix_depth - 1 - K``
tokens long (a trie of depth D holds continuations only D - n deep below a match of n tokens: the
longest match would leave no room for the draft), and a speculation tree is grown from there
greedily by frequency: a node's score is the product of
the empirical probabilities count(child) / count(children) along its branch, the most probable
node is added next (so parents come before children), until the tree holds
``suffix_factor * match length`` nodes (at most K) or the best score falls under ``suffix_min_prob``.
The trie whose tree has the larger total score (its expected number of accepted tokens) drafts.
The draft is deterministic, so the verifier treats it as one-hot proposals: lossless.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import math
from dataclasses import dataclass

import torch

from specdec.proposers.base import Draft, Proposer, draft_budget
from specdec.proposers.options import SpecOptions, option
from specdec.runtime.sequence import Sequence


@dataclass(frozen=True)
class SuffixOptions(SpecOptions):
    method = "suffix"
    summary = ("suffix trees over the request and past outputs propose a frequency-scored token tree "
               "(K: its node budget)")

    suffix_depth: int = option(24, lo=2, hi=256,
                               help="depth of the tries: matches of up to depth - 1 - K tokens, so that K "
                                    "tokens can follow")
    suffix_factor: float = option(2.0, lo=0.0, lo_open=True, hi=64.0,
                                  help="tree nodes per matched token: a longer match drafts a bigger tree")
    suffix_min_prob: float = option(0.1, lo=0.0, hi=1.0,
                                    help="a node whose branch probability (by counts) falls under this is "
                                         "not drafted")
    suffix_cache_tokens: int = option(100_000, lo=0,
                                      help="output tokens of past requests kept in the shared trie (0: none)")

    @property
    def drafts_trees(self) -> bool:
        return True  # always a frequency-scored tree

    def build(self, store) -> "SuffixProposer":
        return SuffixProposer(self.suffix_depth, self.suffix_factor, self.suffix_min_prob, self.suffix_cache_tokens)


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Occurrence counts of every substring of at most ``depth`` tokens of what was inserted."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = _Node()
        self.active = [self.root]  # active[l]: the node of the last l tokens inserted (l < depth)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the text inserted so far (count every new substring)."""
        for t in tokens:
            grown = [self.root]
            for node in self.active:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                child.count += 1
                grown.append(child)
            self.active = grown[:self.depth]

    def end(self) -> None:
        """End the current text: what is inserted next does not continue it."""
        self.active = [self.root]

    def match_end(self, longest: int | None = None) -> tuple[_Node | None, int]:
        """The longest suffix of the inserted text (at most ``longest`` tokens) that occurred before
        with a continuation."""
        for n in range(min(len(self.active) - 1, longest or self.depth), 0, -1):
            if self.active[n].children:
                return self.active[n], n
        return None, 0

    def match(self, context: list[int], longest: int | None = None) -> tuple[_Node | None, int]:
        """The longest suffix of ``context`` (at most ``longest`` and depth - 1 tokens) found here with
        a continuation."""
        for n in range(min(self.depth - 1, len(context), longest or self.depth), 0, -1):
            node: _Node | None = self.root
            for t in context[len(context) - n:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, n
        return None, 0


def grow_tree(node: _Node, size: int, min_prob: float) -> tuple[list[int], list[int], float]:
    """Best-first tree of at most ``size`` continuations below ``node``: (tokens, parents, score),
    parents before children, score the sum of the nodes' branch probabilities."""
    tie = itertools.count()
    heap: list = []

    def push(n: _Node, p: float, parent: int) -> None:
        total = sum(c.count for c in n.children.values())
        for t, c in n.children.items():
            heapq.heappush(heap, (-p * c.count / total, next(tie), t, parent, c))

    push(node, 1.0, -1)
    tokens, parents, score = [], [], 0.0
    while heap and len(tokens) < size:
        neg, _, t, parent, child = heapq.heappop(heap)
        if -neg < min_prob:
            break
        tokens.append(t)
        parents.append(parent)
        score -= neg
        push(child, -neg, len(tokens) - 1)
    return tokens, parents, score


class SuffixProposer(Proposer):
    """A trie per request (prompt + output) and one over past outputs; drafts token trees."""

    drafts_after_unkept_tokens = True  # it catches up on any tokens it has not seen

    def __init__(self, depth: int = 24, factor: float = 2.0, min_prob: float = 0.1,
                 cache_tokens: int = 100_000) -> None:
        self.depth, self.factor, self.min_prob, self.cache_tokens = depth, factor, min_prob, cache_tokens
        self.local: dict[str, tuple[SuffixTrie, list[int]]] = {}  # request id -> (trie, tokens inserted: [n])
        self.past: collections.deque[list[int]] = collections.deque()  # outputs in the shared trie
        self.past_tokens = 0
        self.shared = SuffixTrie(depth)

    def add(self, seq: Sequence) -> None:
        trie = SuffixTrie(self.depth)
        trie.extend(seq.tokens)
        self.local[seq.request_id] = (trie, [seq.num_tokens])

    def remove(self, seq: Sequence) -> None:
        self.local.pop(seq.request_id, None)
        out = list(seq.output_ids)
        if self.cache_tokens <= 0 or not out:
            return
        self.past.append(out[-self.cache_tokens:])
        self.past_tokens += len(self.past[-1])
        self.shared.extend(self.past[-1])
        self.shared.end()
        if self.past_tokens > self.cache_tokens:  # drop the oldest outputs down to 3/4 and recount
            while self.past_tokens > self.cache_tokens * 3 // 4:
                self.past_tokens -= len(self.past.popleft())
            self.shared = SuffixTrie(self.depth)
            for o in self.past:
                self.shared.extend(o)
                self.shared.end()

    def tree_for(self, seq: Sequence, k: int) -> tuple[list[int], list[int]]:
        """The better of the request's and the shared trie's trees for ``seq``, at most ``k`` nodes."""
        if k <= 0:
            return [], []
        trie, done = self.local[seq.request_id]
        trie.extend(seq.tokens[done[0]:])
        done[0] = seq.num_tokens
        best: tuple[list[int], list[int], float] = ([], [], 0.0)
        # a match of n tokens has continuations at most depth - n deep: leave room for k below it
        longest = max(1, self.depth - 1 - k)
        for node, n in (trie.match_end(longest), self.shared.match(seq.tokens, longest)):
            if node is not None:
                cand = grow_tree(node, min(k, max(1, math.ceil(self.factor * n))), self.min_prob)
                if cand[2] > best[2]:
                    best = cand
        return best[0], best[1]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        trees = [self.tree_for(s, kb) for s, kb in zip(seqs, draft_budget(seqs, ks))]
        width = max((len(t) for t, _ in trees), default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        parents = torch.full((len(seqs), width), -1, dtype=torch.long)
        for i, (t, p) in enumerate(trees):
            tokens[i, :len(t)] = torch.tensor(t, dtype=torch.long)
            parents[i, :len(p)] = torch.tensor(p, dtype=torch.long)
        return Draft(tokens=tokens, num_tokens=torch.tensor([len(t) for t, _ in trees]), probs=None,
                     parents=parents)
