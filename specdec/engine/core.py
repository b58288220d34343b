"""The engine core: requests in, one batched speculative step at a time, finished requests out.

``EngineCore`` is what the offline ``LLM``, the server's engine thread and every other driver use:

    core = EngineCore(runner, proposer, make_policy(k, adaptive), max_num_seqs=16)
    core.add(seq)           # queued; admitted (prefilled into a free cache row) by the next step
                            # while the KV pool has blocks for it; a prompt's cached prefix is not
                            # prefilled again (prefix caching, whole prefill chunks: exact)
    core.step()             # admit, then propose -> verify -> accept over the running batch
    core.abort(seq)         # finish now, free its row, its blocks and its proposer / policy state

A long prompt need not stall the running batch: with ``max_prefill_tokens`` set, an admitted
request holds its row while its prompt is prefilled at most that many tokens per step (in whole
chunks of the runner's ``prefill_chunk``, so the cache is written by exactly the calls a one-shot
prefill makes and plain and speculative decoding still start from identical caches), each chunk
followed by the running batch's decode step (Sarathi-style chunked prefill: Agrawal et al. 2024,
"Taming Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve"). Chunks of at most one
batch-invariant product (``row_block``: 32 tokens in bf16) ride inside the decode step's forward
itself (a mixed batch: one read of the weights for both), which writes the very cache a prefill call
of its own would (tests/models/test_llama.py), so outputs do not depend on which way a chunk ran.

A step never raises: ``step`` returns a ``StepResult`` saying what it did and what failed. A
request whose own work raised (its admission, prefill, proposer state or append) is in ``failed``
with its error, already dropped by the core; the others' step went on. The batched propose ->
verify is pure (``speculative_step``): when it raises, the running batch is unchanged, the result
carries the ``error`` (with what the step did before: admissions, prefills, failures) and
``step_each`` then steps the rows one at a time so a driver can find the row that raises. Once a
row has taken its tokens nothing raises (``engine.step.accept``): the step is then published
whole, so no request that finished in it goes unreported.

When a step would not fit the KV pool (its new blocks and the copies copy-on-write makes), the
youngest request is preempted by recompute (its blocks freed, itself first in line again with its
tokens so far); a running request never fails for lack of blocks while the pool holds one request
alone (docs/kv-cache.md).

It owns the draft-length policy and sizes the caches of the target and of the proposer from each
request's own bound (prompt + max_tokens, within the context) plus the draft block (K + 1) plus what
the proposer drafts beyond it (``Proposer.lookahead``). Per-request state (the proposer's, the
policy's) lives exactly as long as the request: it is dropped when the request finishes or is
aborted, never earlier.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from specdec.engine.pacing import PrefillPacer
from specdec.engine.policies import Policy, draft_lengths, make_policy
from specdec.engine.step import accept, speculative_step
from specdec.errors import SpecdecError
from specdec.models.llama import PromptChunk
from specdec.proposers.base import Proposer
from specdec.runtime.kv_cache import KV_BLOCK
from specdec.models.runner import ModelRunner
from specdec.runtime.sequence import Sequence


class RequestFailed(Exception):
    """One request's own work raised; the core has already dropped it (finish reason "abort")."""

    def __init__(self, seq: Sequence, cause: BaseException) -> None:
        super().__init__(f"request {seq.request_id}: {type(cause).__name__}: {cause}")
        self.seq, self.cause = seq, cause


@dataclass
class StepResult:
    """What one ``EngineCore.step`` did.

    stepped: the running rows that took a step (finished ones have left the batch).
    failed: requests whose own work raised, with their errors: already dropped (finish reason "abort").
    error: the batched propose -> verify raised; the running batch is unchanged (step it row by
        row with ``step_each`` to find the row that raises); None when the step ran.
    """

    stepped: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)
    error: Exception | None = None


@dataclass
class StepTimes:
    draft: float = 0.0
    verify: float = 0.0
    other: float = 0.0


class EngineCore:
    """Continuous batching over one model runner: at most ``max_num_seqs`` requests run at once."""

    def __init__(self, runner: ModelRunner, proposer: Proposer | None = None, policy: Policy | None = None,
                 max_num_seqs: int = 16, max_prefill_tokens: int | None = None, prefix_caching: bool = True,
                 prefill_slowdown: float | None = None) -> None:
        if max_num_seqs < 1:
            raise SpecdecError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise SpecdecError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.runner, self.max_num_seqs = runner, max_num_seqs
        # prompt tokens prefilled per step, in whole runner chunks (None: a whole prompt at admission)
        chunk = runner.prefill_chunk
        self.prefill_budget = None if max_prefill_tokens is None else max(1, max_prefill_tokens // chunk) * chunk
        # with streams decoding, fewer: a step with prompt tokens takes at most prefill_slowdown x one without
        self.pacer = (PrefillPacer(prefill_slowdown, self.prefill_budget, 1 if self._cut_anywhere() else chunk)
                      if prefill_slowdown and self.prefill_budget is not None else None)
        self.policy: Policy = policy if policy is not None else make_policy(0)
        self.k = self.policy.max_k  # 0: plain decoding
        self.proposer = proposer if self.k else None  # None: no drafts (none configured, or K = 0)
        self.prefix_caching = prefix_caching
        runner.share_prompts = prefix_caching  # a prompt identical to one in flight maps its blocks
        self.num_preemptions = 0
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []  # holding a row, prompt partly prefilled (oldest first)
        self._prefilled: dict[str, int] = {}  # request_id -> prompt tokens already in its cache row
        self._solo_prefill = False  # the last step with riding prompt chunks raised (see _riding_chunks)
        self.times = StepTimes()

    # ---- sizing ---------------------------------------------------------------------------
    def slots_for(self, length: int) -> int:
        """Cache positions a request of up to ``length`` tokens may touch: those, the draft block
        (K + 1) and what the proposer drafts beyond it."""
        return length + self.k + 1 + (self.proposer.lookahead() if self.proposer is not None else 0)

    def slots_needed(self, seq: Sequence) -> int:
        return self.slots_for(min(len(seq.prompt_ids) + seq.params.max_tokens, seq.max_len))

    def reserve(self, rows: int, slots: int) -> None:
        """Size the caches for ``rows`` requests of up to ``slots`` positions (keeps what they hold)."""
        cache = self.runner.ensure_cache(min(rows, self.max_num_seqs), slots)
        if self.proposer is not None:
            self.proposer.prepare(cache.rows, cache.max_len, self.runner.num_blocks)

    # ---- requests -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; the next ``step`` admits it when a row is free."""
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Stop ``seq`` now (finish reason "abort"), freeing its row and state; waiting or running."""
        if not seq.finished:
            seq.finish("abort", None)
        if any(s is seq for s in self.waiting):
            self.waiting = collections.deque(s for s in self.waiting if s is not seq)
        if any(s is seq for s in self.prefilling):
            self.prefilling = [s for s in self.prefilling if s is not seq]
            self._prefilled.pop(seq.request_id, None)
            self.runner.cache.free(seq.row)
        if any(s is seq for s in self.running):
            self.running = [s for s in self.running if s is not seq]
            self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def num_free(self) -> int:
        return self.max_num_seqs - len(self.running) - len(self.prefilling)

    def in_flight(self) -> list[Sequence]:
        """Every request the core holds: waiting, prefilling and running."""
        return list(self.waiting) + self.prefilling + self.running

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> StepResult:
        """Admit waiting requests into free rows, prefill (at most the budget), then one
        propose -> verify -> accept step over the running batch. Never raises: returns what was
        stepped, the requests that failed (dropped; the others are untouched) and the batched
        step's error (the running batch unchanged: ``step_each`` or simply another step)."""
        result = StepResult()
        self._admit_waiting(result)
        self._make_room()
        batch = len(self.running)
        paced = self.pacer is not None and self.prefilling
        plan = self._prefill_plan(self.pacer.budget(batch) if paced else self.prefill_budget)
        chunks = self._riding_chunks(plan)
        t0 = time.perf_counter()
        if chunks is None:
            self._prefill(plan, result)
        try:
            self._decode(self.running, result, chunks)
        except Exception as e:  # noqa: BLE001 (propose -> verify raised: no row has changed)
            if chunks is not None:
                self._solo_prefill = True  # next step prefills alone, so a prompt's own error is its own
            result.error = e
            return result
        if self.pacer is not None:
            self.pacer.observe(batch, time.perf_counter() - t0, sum(hi - lo for _, lo, hi in plan))
        for seq, _, hi in plan if chunks is not None else ():
            self._prefilled_to(seq, hi, result)
        return result

    def step_each(self) -> tuple[list[Sequence], list[tuple[Sequence, Exception]]]:
        """Step the running rows one at a time (after a batched step raised): returns the rows
        stepped and, aborted, the rows that failed with their errors."""
        result = StepResult()
        for s in list(self.running):
            if s.finished:  # it left the batch in an earlier row's step (cannot happen: defensive)
                continue
            try:
                self._decode([s], result)
            except Exception as e:  # noqa: BLE001 (the driver reports it as this request's error)
                result.failed.append((s, e))
                self._drop(s)
        return result.stepped, result.failed

    def _decode(self, seqs: list[Sequence], result: StepResult, chunks: list[PromptChunk] | None = None) -> None:
        """One step over ``seqs`` (running rows), prefilling ``chunks`` in its forward, into ``result``.
        Raises only from propose -> verify, before any row has changed; after that, rows whose own
        accept failed are dropped into ``result.failed`` and the finished ones leave the batch."""
        if not seqs:
            return
        t0 = time.perf_counter()
        ks = draft_lengths(self.policy, seqs, self.proposer.verify) if self.proposer is not None else [0] * len(seqs)
        out = speculative_step(self.runner, self.proposer, seqs, ks, chunks or ())
        failed = accept(seqs, out, self.proposer, self.policy)
        for s, e in failed:
            result.failed.append((s, e))
            self._drop(s)
        bad = {id(s) for s, _ in failed}
        result.stepped += [s for s in seqs if id(s) not in bad]
        self.running = [s for s in self.running if not s.finished]
        for s in seqs:
            if s.finished and id(s) not in bad:
                try:
                    self._release(s)
                except Exception:  # noqa: BLE001 (it finished correctly; only bookkeeping failed)
                    logging.getLogger(__name__).exception("forgetting a finished request failed")
        self.times.draft += out.draft_seconds
        self.times.verify += out.verify_seconds
        self.times.other += time.perf_counter() - t0 - out.draft_seconds - out.verify_seconds

    def _drop(self, seq: Sequence) -> None:
        """Abort ``seq`` after its own work failed; whatever raises, it is out of the batch."""
        try:
            self.abort(seq)
        except Exception:  # noqa: BLE001 (it is out of the batch; its state may leak)
            logging.getLogger(__name__).exception("dropping a failed request")
            self.running = [s for s in self.running if s is not seq]

    # ---- memory: admission by free blocks, preemption by recompute ----------------------------------
    def _next_blocks(self) -> int:
        """Blocks the requests held need for their next step (drafts included) or the rest of their
        prompts and first step (``_blocks_of``)."""
        return (sum(self._blocks_of(s, s.num_tokens - 1) for s in self.running)
                + sum(self._blocks_of(s, self._prefilled[s.request_id]) for s in self.prefilling))

    def _blocks_of(self, seq: Sequence, start: int) -> int:
        """Blocks a held request takes from the pool writing slots ``start..`` up to its next step's
        drafts (the step a prompt prefilled alone also takes at once): the unmapped ones and a copy of
        each shared block it writes into (copy-on-write: ``n`` choices sharing a prompt's last block,
        a cached prefix cut inside a block)."""
        return self.runner.cache.blocks_needed(seq.row, self.slots_for(len(seq.tokens)), start)

    def _fits(self, seq: Sequence, pending: int) -> bool:
        """Admit while the pool has blocks for ``seq``'s prompt and next step beside what the others
        need (``pending``: ``_next_blocks()``; a request alone always enters: it has the whole pool)."""
        cache = self.runner.cache
        if cache is None or not (self.running or self.prefilling):
            return True
        need = -(-self.slots_for(seq.num_tokens) // KV_BLOCK)
        return need + pending <= cache.pool.num_free

    def _admit_waiting(self, result: StepResult) -> None:
        """Admit waiting requests, oldest first, while rows are free and they fit. What the held requests
        need is summed once and then grown by each admitted prompt's blocks (summing it again for every
        admission made a step over thousands of waiting requests quadratic), and summed afresh whenever
        an admission regrew the cache (a longer row changes what the others need)."""
        pending, shape = 0, None
        while self.waiting and self.num_free() > 0:
            cache = self.runner.cache
            now = None if cache is None else (id(cache), cache.max_len)
            if now != shape:
                pending, shape = (0 if cache is None else self._next_blocks()), now
            if not self._fits(self.waiting[0], pending):
                return
            seq = self.waiting.popleft()
            try:
                self._admit(seq)
            except RequestFailed as e:
                result.failed.append((e.seq, e.cause))
                continue
            cache = self.runner.cache
            if (id(cache), cache.max_len) == shape:
                pending += self._blocks_of(seq, self._prefilled[seq.request_id])

    def _make_room(self) -> None:
        """Preempt the youngest requests until the others' next step has its blocks: a preempted one
        gives its blocks back and waits first in line with its tokens, prompt and output, prefilled
        again when it returns (recompute; its prefix blocks may still be cached)."""
        cache = self.runner.cache
        while cache is not None and len(self.running) + len(self.prefilling) > 1 and self._next_blocks() > cache.pool.num_free:
            if self.prefilling:
                seq = self.prefilling.pop()
                del self._prefilled[seq.request_id]
                cache.free(seq.row)
            else:
                seq = self.running.pop()
                self._release(seq)
            self.waiting.appendleft(seq)
            self.num_preemptions += 1

    def _admit(self, seq: Sequence) -> None:
        """Give ``seq`` a free cache row (its prompt is prefilled by ``_prefill``)."""
        try:
            cache = self.runner.cache
            need = self.slots_needed(seq)
            held = len(self.running) + len(self.prefilling)
            if cache is None or cache.rows <= held or cache.max_len < need:
                self.reserve(held + 1 + len(self.waiting), need)
            used = {s.row for s in self.running} | {s.row for s in self.prefilling}
            seq.row = next(r for r in range(self.runner.cache.rows) if r not in used)
            cached = self._reuse_prefix(seq)
        except Exception as e:
            seq.finish("abort", None)
            raise RequestFailed(seq, e) from e
        self.prefilling.append(seq)
        self._prefilled[seq.request_id] = cached

    def _reuse_prefix(self, seq: Sequence) -> int:
        """Map the cached prefix of ``seq``'s prompt into its row; returns how many positions need no
        prefill: none when it wants every prompt token's logprobs, at most what a proposer that reads
        the prompt's hidden states holds in its own prefix cache."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return 0
        held = self.proposer.reuse_prefix(seq) if self.proposer is not None else None
        return self.runner.reuse_prefix(seq.row, seq.tokens[:-1] if held is None else seq.tokens[:held])

    def _cut_anywhere(self) -> bool:
        """Whether a prompt may be cut at any token: its prefill runs on the native path (chunks of one
        batch-invariant product at most), which writes the same cache bits wherever its pieces end
        (tests/models/test_native.py); elsewhere only where a one-shot prefill's chunks end."""
        return getattr(self.runner.model, "native", None) is not None and self.runner.small_chunks

    def _prefill_plan(self, budget: int | None) -> list[tuple[Sequence, int, int]]:
        """The prompt pieces ``(seq, lo, hi)`` this step prefills: oldest first, at most ``budget``
        tokens in all (whole prompts without one), a piece cut short stopping on a chunk boundary,
        where a one-shot prefill's chunk ends (anywhere on the native path)."""
        chunk, plan = 1 if self._cut_anywhere() else self.runner.prefill_chunk, []
        for seq in self.prefilling:
            if budget is not None and budget <= 0:
                break
            todo = len(seq.tokens) - 1  # all its tokens but the pending last one
            lo = self._prefilled[seq.request_id]
            hi = todo if budget is None else min(todo, lo + budget)
            if hi < todo:
                hi = lo + (hi - lo) // chunk * chunk
                if hi == lo:
                    break
            plan.append((seq, lo, hi))
            if budget is not None:
                budget -= hi - lo
        return plan

    def _riding_chunks(self, plan: list[tuple[Sequence, int, int]]) -> list[PromptChunk] | None:
        """The plan as chunks prefilled inside the decode step's forward (mixed batches: the
        weights are read once for both, so the running streams keep their pace), or None where
        the plan runs as prefill calls of its own: no running batch to ride, chunks longer than a
        batch-invariant product (``row_block``: a riding chunk must write the cache a call of its own
        writes), a request that wants prompt logprobs or a drafter that reads the prompt's hidden
        states, or the last riding step raised."""
        if (not plan or not self.running or self.prefill_budget is None or self._solo_prefill
                or not self.runner.small_chunks
                or (self.proposer is not None and self.proposer.hidden_layers)
                or any(s.params.prompt_logprobs is not None for s, _, _ in plan)):
            self._solo_prefill = False
            return None
        chunk = self.runner.prefill_chunk
        return [c for s, lo, hi in plan for c in PromptChunk.split(s.row, s.tokens[lo:hi], lo, chunk)]

    def _prefill(self, plan: list[tuple[Sequence, int, int]], result: StepResult) -> None:
        """Run the plan's pieces as prefill calls of their own; a prompt done joins the running batch.
        A piece that raises drops its request into ``result.failed``; the others go on."""
        for seq, lo, hi in plan:
            t0 = time.perf_counter()
            try:
                # a prompt-logprobs pass only for the requests that asked: every prompt token's logits
                want = seq.params.prompt_logprobs is not None
                hidden = self.proposer.hidden_layers if self.proposer is not None else ()  # feature drafters
                out = self.runner.prefill(seq.row, seq.tokens[lo:hi], start=lo, hidden_layers=hidden,
                                          on_logits=seq.add_prompt_logprobs if want else None)
                if hidden and out is not None:
                    self.proposer.on_prefill(seq, lo, out)
            except Exception as e:  # noqa: BLE001 (this request's own prefill: it alone fails)
                result.failed.append((seq, e))
                self._drop(seq)
                continue
            finally:
                self.times.other += time.perf_counter() - t0
            self._prefilled_to(seq, hi, result)

    def _prefilled_to(self, seq: Sequence, hi: int, result: StepResult) -> None:
        """``seq``'s prompt is in its cache row up to ``hi``; done, it joins the running batch (and
        the proposer; if the proposer's ``add`` raises, it is dropped into ``result.failed``)."""
        if hi == len(seq.tokens) - 1:
            if self.prefix_caching:
                self.runner.offer_prefix(seq.row, seq.tokens[:-1])
            if self.proposer is not None:
                try:
                    self.proposer.add(seq)
                except Exception as e:  # noqa: BLE001 (this request's own proposer state: it alone fails)
                    result.failed.append((seq, e))
                    self._drop(seq)
                    return
            self.prefilling.remove(seq)
            del self._prefilled[seq.request_id]
            self.running.append(seq)
        else:
            self._prefilled[seq.request_id] = hi

    def _release(self, seq: Sequence) -> None:
        """Drop the proposer's and the policy's state of a request leaving the batch, and give its
        cache blocks back."""
        try:
            if self.proposer is not None:
                self.proposer.remove(seq)
        finally:
            self.policy.forget(seq)
            self.runner.cache.free(seq.row)
