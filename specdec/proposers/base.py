"""The Proposer interface every speculation method implements, and the Draft it returns.

A proposer knows nothing of acceptance rules: it proposes, the verifier decides, and the engine
tells the proposer how many tokens each row accepted (the begin / draft / accept life cycle of
llama.cpp's drafters; transformers' get_candidates / update_candidate_strategy).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.runtime.sequence import Sequence
from specdec.sampling.grammar import DraftMasks
from specdec.sampling.penalties import Penalties
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rng import DRAFT, NOISE, RowKeys


@dataclass
class Draft:
    """Draft tokens for each running sequence.

    tokens: (B, K) long, row b's draft in ``tokens[b, :num_tokens[b]]`` (the rest is padding).
    num_tokens: (B,) long.
    probs: (B, K, V) float, the distribution each draft token was sampled from (after the
        request's own penalties, temperature / top-k / top-p / min-p), or None for a deterministic draft
        (n-gram lookup): the verifier then treats each token as a one-hot proposal. In a tree:
        the distribution node i was drawn from given its earlier siblings.
    parents: (B, K) long, or None for a chain: a token tree (``engine.tree``), node i's parent
        (-1: a child of the pending token; parents precede their children). Row b's K nodes are
        then verified in one forward and the longest acceptable path is kept.
    """

    tokens: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None


class Proposer:
    """What the engine calls, in this order: prepare, add, then propose/on_accept per step, remove.

    Every method subclasses this; the defaults suit a stateless proposer (n-gram lookup).
    """

    #: target layers whose hidden states the proposer reads from each verification forward
    hidden_layers: tuple[int, ...] = ()
    #: it drafts from a sequence's tokens alone (its own state catches up on tokens it has not seen),
    #: so it can draft after tokens the target has not verified yet (the grammar's forced tokens)
    drafts_after_unkept_tokens: bool = False
    #: how sampled rows are verified (``SpecOptions.verify``): "rejection" (speculative sampling) or
    #: "gumbel" (Gumbel-max equality, ``sampling.gumbel``: a model drafter then proposes the
    #: Gumbel-argmax of its own distribution with the target's noise)
    verify: str = "rejection"

    def set_verify(self, mode: str) -> None:
        """Verify (and draft) by ``mode``; a proposer wrapping others passes it on."""
        self.verify = mode

    def lookahead(self) -> int:
        """Cache slots the proposer may write past the target's own draft block (a cascade's inner
        stage drafts ahead of its drafter); the engine sizes every cache with it."""
        return 0

    def reuse_prefix(self, seq: Sequence) -> int | None:
        """``seq`` was just given its row and the target may skip prefilling the cached prefix of its
        prompt: None where the proposer's state can start anywhere (it does not read the prompt's
        hidden states, or keeps its own prefix cache), else how many leading prompt positions it holds
        already (mapped from its own prefix cache): the target then skips at most that many, and
        ``on_prefill`` gives the proposer the hidden states of every position from there on."""
        return None

    def fit_draft_length(self, k: int) -> None:
        """Drafts of up to ``k`` tokens will be asked for (a call's K may exceed the configured one): widen any
        state sized by the draft length (a hybrid draft model's state rings), as the engine widens the
        target's. Called between requests, before ``prepare``."""

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        """Size any per-row state (a draft model's KV cache) like the target's cache, keeping what
        it holds (the engine grows caches while requests run); ``num_blocks``: a KV cache's pool
        (None: enough for every row's every slot)."""

    def on_prefill(self, seq: Sequence, start: int, forward) -> None:
        """The target prefilled ``seq``'s prompt tokens from position ``start`` on (in one or more
        calls, before ``add``; all its tokens but the pending one in all): ``forward.hidden`` holds
        the states of ``hidden_layers`` at each of them. Called only for a proposer that names
        ``hidden_layers``."""

    def add(self, seq: Sequence) -> None:
        """A sequence joined the batch in cache row ``seq.row`` (prefill own state)."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        """Up to ``ks[i]`` draft tokens for sequence i, never more than ``seq.room - 1``."""
        raise NotImplementedError

    def on_verified(self, seqs: list[Sequence], forward) -> None:
        """The verification forward's output (``models.llama.ForwardOutput``: logits and the hidden
        states of ``hidden_layers``) for the block the rows just verified; called before on_accept."""

    def on_path(self, seqs: list[Sequence], paths: list[list[int]]) -> None:
        """After a tree draft, before on_verified: row i kept the nodes ``paths[i]`` of its draft, in
        order (a drafter whose cache holds tree nodes moves the kept ones into place)."""

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        """Row i kept ``num_accepted[i]`` draft tokens (plus one token of the target's)."""

    def remove(self, seq: Sequence) -> None:
        """The sequence finished or was aborted; forget it."""


def draft_budget(seqs: list[Sequence], ks: list[int]) -> list[int]:
    """Per-row draft length: at most ks[i], and leave room for the target's own extra token."""
    return [max(0, min(k, s.room - 1)) for s, k in zip(seqs, ks)]


def empty_draft(rows: int, device: torch.device | str) -> Draft:
    return Draft(torch.zeros(rows, 0, dtype=torch.long, device=device), torch.zeros(rows, dtype=torch.long))


def autoregressive_draft(seqs: list[Sequence], budget: list[int],
                         next_logits: Callable[[int, torch.Tensor | None], torch.Tensor],
                         confidence_threshold: float, device: torch.device | str, gumbel: bool = False) -> Draft:
    """The drafting loop of model-based proposers (draft model, layer skip), one token per call.

    ``next_logits(j, prev)`` returns the (B, V) logits of draft token j, ``prev`` being token j-1
    (None for j = 0). Tokens are the argmax (all rows greedy) or sampled with each request's own
    parameters through the shared ``logits_to_probs`` (the probabilities go to the verifier), after
    the request's penalties and logit bias counting the tokens drafted so far: the same processed
    distribution the target verifies against.
    A row whose token's probability falls under ``confidence_threshold`` keeps that token (its
    forward is paid for and verifying it is nearly free) and stops after it: ``budget`` (per-row
    draft lengths) is lowered in place.

    Draft token j of a row decides its position ``num_tokens + j``, and its randomness is keyed by
    that position (``sampling.rng``), so a row's draft does not depend on the batch or on how many
    rounds the other rows need. ``gumbel``: the token is the Gumbel-argmax of the row's distribution
    with the target's own noise at that position (``sampling.gumbel``); else it is sampled by inverse
    CDF with the DRAFT uniform, independent of every draw the verifier makes.
    """
    if max(budget, default=0) == 0:
        return empty_draft(len(seqs), device)
    params = [s.params for s in seqs]
    greedy = all(p.greedy for p in params)
    st = None if greedy else SamplingTensors.from_params(params, device)
    keys = None if greedy else RowKeys.from_seqs(seqs, device, shared_noise=gumbel)
    pen = Penalties.from_seqs(seqs, device)  # None (free) unless some row has penalties or a bias
    masks = DraftMasks.from_seqs(seqs)  # None unless some row is constrained
    try:
        return _draft_loop(budget, next_logits, confidence_threshold, device, greedy, st, keys, pen, masks, gumbel)
    finally:
        if masks is not None:
            masks.release()  # the matchers follow only kept tokens


def _draft_loop(budget, next_logits, confidence_threshold, device, greedy, st, keys, pen, masks, gumbel) -> Draft:
    drafted, probs, tok = [], [], None
    for j in range(max(budget)):
        logits = next_logits(j, tok)  # (B, V)
        if pen is not None:
            logits = pen.apply(logits, torch.stack(drafted, 1) if drafted else None)
        if masks is not None:  # the legal set after the row's kept tokens and its draft so far
            logits = masks.apply(logits)
        conf = None
        if greedy:
            tok = logits.argmax(-1)  # (B,)
            if confidence_threshold > 0:
                conf = torch.softmax(logits.float(), dim=-1).max(-1).values
        else:
            q = logits_to_probs(logits, st)  # (B, V)
            if gumbel:  # rows past their budget draw no noise (their token is dropped)
                live = torch.tensor([j < b for b in budget], device=q.device)
                tok = q.argmax(-1)
                if bool(live.any()):
                    rows = live.nonzero()[:, 0]
                    tok[rows] = keys.gumbel_argmax(q[rows], j, NOISE, rows=rows)
            else:
                tok = keys.sample_cdf(q, j, DRAFT)
            probs.append(q)
            conf = q.gather(-1, tok[:, None])[:, 0]
        drafted.append(tok)
        if masks is not None and j + 1 < max(budget):
            masks.advance(tok)
        if confidence_threshold > 0:
            for b in torch.nonzero(conf < confidence_threshold).flatten().tolist():
                budget[b] = min(budget[b], j + 1)
        if j + 1 >= max(budget):
            break
    width = max(budget)
    return Draft(tokens=torch.stack(drafted, 1)[:, :width], num_tokens=torch.tensor(budget, device=device),
                 probs=torch.stack(probs, 1)[:, :width] if probs else None)


def trained_context(model) -> int:
    """Prompt tokens a draft model reads at most: its trained positions (``max_position_embeddings``)
    less room for the tokens it drafts and the answer (an eighth, at least 32, at most 1,024). A longer
    prompt is read through a window of its last tokens, as ``draft_context`` asks: past its positions
    a model drafts noise (SmolLM2-135M, 8,192 positions, drafting for a 16k-token prompt accepted 1% of
    its drafts; docs/bench/long-context.md)."""
    limit = model.config.max_position_embeddings
    return max(1, limit - min(1024, max(32, limit // 8)))
