"""One speculative step, pure: propose -> verify (one target forward) -> accept.

``speculative_step`` proposes drafts for a batch, scores them with one forward of ``runner``'s model
and verifies them (greedy matching, or with the request's own parameters and keyed randomness:
lossless rejection sampling, or Gumbel-max equality when the proposer's ``verify`` is "gumbel",
``sampling.gumbel``); it changes no sequence. ``accept`` then appends the emitted tokens, counts
what each sequence emitted (``engine.accounting``) and tells the proposer and the draft-length
policy what happened; it never raises (it returns the rows that failed), so a step that has changed
a sequence always completes.

The engine core runs these two over its batch every step; a cascade runs the same two over its
drafter (the drafter verifying its own cheaper proposer's drafts), so every stage of every method
goes through one verification path. Plain decoding is a step whose drafts are all empty: every row
emits the target's own next token (the "bonus" token of an empty chain).

A draft may be a token tree (``Draft.parents``, see ``engine.tree``): the block is scored with
depth-based positions and an ancestors-only mask, verified by the tree rules of
``sampling.rejection``, and the accepted path's keys and values move to the slots a chain would use
(``KVCache.copy_slots``). The step's outputs then read as a chain: ``forward`` and ``target_probs``
hold the accepted path's positions in order, and the proposer hears which nodes were kept
(``Proposer.on_path``). A chain is the tree whose parents are ``i - 1``, scored with the causal mask.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specdec.engine.accounting import count_step
from specdec.engine.tree import ancestor_mask, branch_tokens, compaction, normalize_parents, path_order
from specdec.models.llama import ForwardOutput, PromptChunk
from specdec.proposers.base import Draft, Proposer
from specdec.models.runner import ModelRunner
from specdec.runtime.sequence import Sequence
from specdec.sampling.grammar import apply_masks, block_masks
from specdec.sampling.gumbel import verify_gumbel, verify_tree_gumbel
from specdec.sampling.logprobs import TokenLogprob, token_logprobs
from specdec.sampling.penalties import Penalties
from specdec.sampling.probs import SamplingTensors, logits_to_probs
from specdec.sampling.rejection import verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_sampled
from specdec.sampling.rng import RowKeys

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step decided for each row of its batch.

    emitted[i]: the row's accepted draft tokens then the target's own token (recovered or bonus).
    target_probs: (B, K+1, V) the target's processed distributions at every verified position
        (one-hot on greedy rows), or None when every row was greedy: a cascade hands them on as
        the real q of the tokens its drafter emitted.
    """

    num_draft: list[int]
    num_accepted: list[int]
    emitted: list[list[int]]
    target_probs: torch.Tensor | None
    forward: ForwardOutput
    proposed: bool  # the proposer was asked for drafts (False: a plain step)
    draft_seconds: float
    verify_seconds: float
    # per row: the raw log-probabilities of its emitted tokens (rows that asked), else None
    logprobs: list[list[TokenLogprob] | None] | None = None
    # a tree draft: per row, the accepted nodes (indices into its draft) and the tree's depth
    paths: list[list[int]] | None = None
    depths: list[int] | None = None


def speculative_step(runner: ModelRunner, proposer: Proposer | None, seqs: list[Sequence],
                     ks: list[int], prompt_chunks: Seq[PromptChunk] = ()) -> StepOutput:
    """Draft up to ``ks[i]`` tokens for row i, verify them in one forward; change nothing yet
    (but the cache of ``prompt_chunks``: pieces of other requests' prompts prefilled in that forward)."""
    device = runner.device
    t0 = time.perf_counter()
    B = len(seqs)
    draft: Draft | None = proposer.propose(seqs, ks) if proposer is not None and any(ks) else None
    t1 = time.perf_counter()
    last = torch.tensor([[s.tokens[-1]] for s in seqs], device=device)  # (B, 1) the pending tokens
    start = torch.tensor([[s.num_tokens - 1] for s in seqs], device=device)  # (B, 1)
    if draft is None:
        tokens = last
        draft_ids = torch.zeros(B, 0, dtype=torch.long, device=device)
        num_draft = torch.zeros(B, dtype=torch.long, device=device)
    else:
        draft_ids, num_draft = draft.tokens.to(device), draft.num_tokens.to(device)
        tokens = torch.cat([last, draft_ids.clamp(min=0)], dim=1)  # (B, 1+K)
    slots = start + torch.arange(tokens.shape[1], device=device)  # (B, 1+K)
    rows = torch.tensor([s.row for s in seqs], device=device)
    hidden = proposer.hidden_layers if proposer is not None else ()
    parents = None if draft is None or draft.parents is None else normalize_parents(draft.parents.to(device),
                                                                                     num_draft)
    tree: dict = {}
    positions = slots
    if parents is not None:  # depth-based positions, ancestors-only mask, consecutive slots
        mask = ancestor_mask(parents)  # (B, 1+K, 1+K)
        positions = start + mask.sum(-1) - 1  # (B, 1+K)
        tree = dict(cache_pos=slots, attn_mask=mask)
    fwd = runner.forward(tokens, positions, None if rows.tolist() == list(range(B)) else rows,
                         hidden_layers=hidden, prompt_chunks=prompt_chunks, **tree)
    params = [s.params for s in seqs]
    pen = Penalties.from_seqs(seqs, device)  # None (free) unless some row has penalties or a bias
    # (B, 1+K, V): at position j the penalties count the drafts before j, as plain decoding would
    logits = fwd.logits
    if pen is not None and parents is None:
        logits = pen.apply(fwd.logits, draft_ids)
    elif pen is not None:  # each position counts its own branch
        before = branch_tokens(draft_ids, tree["attn_mask"][:, 1:, 1:])  # (B, 1+K, K)
        logits = torch.stack([pen.apply(fwd.logits[:, j], before[:, j]) for j in range(before.shape[1])], 1)
    # constrained rows: each position's legal set, the matcher advanced through the draft before it
    allowed = block_masks(seqs, draft_ids, num_draft, parents, logits.shape[-1])
    if allowed is not None:
        logits = apply_masks(logits, allowed)
    probs, path = None, None
    if all(p.greedy for p in params):
        if parents is None:
            out_ids, n_acc = verify_greedy(draft_ids, logits, num_draft)
        else:
            out_ids, n_acc, path = verify_tree_greedy(draft_ids, parents, logits, num_draft)
    else:
        probs = logits_to_probs(logits, SamplingTensors.from_params(params, device))  # (B, 1+K, V)
        # no draft: either rule is plain decoding's Gumbel-max draw (a cascade's inner stage must still
        # read the outer stage's noise under Gumbel verification)
        gumbel = proposer is not None and proposer.verify == "gumbel"
        keys = RowKeys.from_seqs(seqs, device, shared_noise=gumbel)
        q = draft.probs if draft is not None else None
        if gumbel and parents is None:
            out_ids, n_acc = verify_gumbel(draft_ids, probs, num_draft, keys)
        elif gumbel:
            out_ids, n_acc, path = verify_tree_gumbel(draft_ids, parents, probs, num_draft, keys)
        elif parents is None:
            out_ids, n_acc = verify_sampled(draft_ids, q, probs, num_draft, keys)
        else:
            out_ids, n_acc, path = verify_tree_sampled(draft_ids, parents, q, probs, num_draft, keys)
    paths = depths = None
    if path is not None:  # move the accepted path into place; read the outputs in path order
        paths = [[n for n in row if n >= 0] for row in path.tolist()]
        bs, src, dst = compaction(paths, start[:, 0].tolist())
        if bs:
            runner.cache.copy_slots(rows[bs], torch.tensor(src, device=device), torch.tensor(dst, device=device))
        order = path_order(path)  # (B, 1+K)
        fwd = ForwardOutput(logits=_take(fwd.logits, order),
                            hidden={k: _take(h, order) for k, h in fwd.hidden.items()})
        probs = None if probs is None else _take(probs, order)
        depths = (positions - start).max(-1).values.tolist()
    t2 = time.perf_counter()
    n_acc_l, out_l = n_acc.tolist(), out_ids.tolist()
    lps = None
    if any(p.logprobs is not None for p in params):  # only the rows that asked, from this forward
        lps = [None if p.logprobs is None else token_logprobs(fwd.logits[i, :a + 1], out_ids[i, :a + 1], p.logprobs)
               for i, (p, a) in enumerate(zip(params, n_acc_l))]
    return StepOutput(num_draft=num_draft.tolist(), num_accepted=n_acc_l,
                      emitted=[o[:a + 1] for o, a in zip(out_l, n_acc_l)], target_probs=probs, forward=fwd,
                      proposed=draft is not None, draft_seconds=t1 - t0, verify_seconds=t2 - t1, logprobs=lps,
                      paths=paths, depths=depths)


def _take(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x (B, T, ...)`` at block positions ``order (B, T)``."""
    return x.gather(1, order.view(*order.shape, *([1] * (x.dim() - 2))).expand(*order.shape, *x.shape[2:]))


def accept(seqs: list[Sequence], out: StepOutput, proposer: Proposer | None,
           policy) -> list[tuple[Sequence, Exception]]:
    """Append each row's emitted tokens, count what it emitted (``engine.accounting``), and report the
    step to proposer and policy. Never raises: the tokens are the target's verified output and stay.
    Returns the rows that failed, with their errors, for the caller to drop: a row whose own append
    raised, or whose proposer state could not be rebuilt after the proposer's callbacks raised (they
    see the whole batch, so on an error every row still running is dropped from the proposer and
    added again, as after a preemption; drafts are verified, so a rebuilt state changes no output)."""
    seconds = out.draft_seconds + out.verify_seconds
    failed: list[tuple[Sequence, Exception]] = []
    for i, (s, nd, na, em) in enumerate(zip(seqs, out.num_draft, out.num_accepted, out.emitted)):
        s.draft_seconds += out.draft_seconds
        s.verify_seconds += out.verify_seconds
        try:
            taken = s.append(em)
        except Exception as e:  # noqa: BLE001 (this row's own error: it alone is dropped)
            failed.append((s, e))
            continue
        npos = nd if out.depths is None else min(nd, out.depths[i])  # a tree: positions are depths
        count_step(s, nd, na, taken, npos)
        if out.logprobs is not None and out.logprobs[i] is not None:
            s.output_logprobs.extend(out.logprobs[i][:taken])
    if proposer is None:
        return failed
    try:
        if out.paths is not None:
            proposer.on_path(seqs, out.paths)
        proposer.on_verified(seqs, out.forward)
        proposer.on_accept(seqs, out.num_accepted)
    except Exception:  # noqa: BLE001 (the proposer's state of these rows is unknown: rebuild it)
        log.exception("the proposer's step callbacks raised: rebuilding its state of the batch's rows")
        bad = {id(s) for s, _ in failed}
        for s in seqs:
            if id(s) in bad or s.finished:
                continue  # leaving the batch: the caller removes it from the proposer
            try:
                proposer.remove(s)
                proposer.add(s)
            except Exception as e:  # noqa: BLE001 (this row's state cannot be rebuilt: it is dropped)
                failed.append((s, e))
    try:
        B = len(seqs)
        if not out.proposed:
            policy.observe_plain(B, seconds)  # what drafting must beat at this batch size
        elif not any(out.num_draft):  # asked, drafted nothing (no n-gram matched): a plain step all the same
            policy.observe_plain(B, out.verify_seconds, asked=True)
        for s, nd, na in zip(seqs, out.num_draft, out.num_accepted):
            policy.update(s, nd, na, seconds, B)
    except Exception:  # noqa: BLE001 (the draft-length policy starts afresh for these rows)
        log.exception("the draft-length policy raised: forgetting the batch's rows")
        for s in seqs:
            try:
                policy.forget(s)
            except Exception:  # noqa: BLE001
                log.exception("the draft-length policy could not forget a row")
    return failed
