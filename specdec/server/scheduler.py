"""The server's engine thread: continuous batching with load-aware speculation.

Design
------
One background thread owns the model, its KV cache (``max_batch_size`` rows x ``max_model_len``
positions plus room for a draft) and one ``Engine``. The asyncio side never touches them: a request
handler builds its ``Sequence`` objects (one per choice), hands them to ``submit`` and reads
``Event`` objects from its ``RequestHandle``'s asyncio queue. The thread loops:

1. take the pending cancellations and drop those sequences (``Engine.cancel``: the cache row, the
   proposer's state and the draft-length policy's state are freed at once);
2. admit waiting sequences, oldest first, into free rows (``Engine.add`` prefills them); the rest
   stay in the waiting queue;
3. run one ``Engine.step`` (propose -> verify -> accept) over the whole running batch;
4. send each sequence's new text to its request (``loop.call_soon_threadsafe``), holding back the
   last ``len(longest stop string) - 1`` characters while a stop string may still be forming, and
   a final event when it finishes; finished sequences have already left the batch.

When nothing runs or waits the thread sleeps on a condition variable.

Speculation adapts to load (``LoadAwareK``): a step verifies B x (K + 1) tokens, and on this CPU a
forward over T tokens costs about one token's up to T = 4, 1.2x at 8 and 1.55x at 16 (BENCHMARKS.md),
so K is capped at ``rows_budget // B - 1`` (at least 1), and above ``spec_max_batch`` sequences no draft
is made at all; speculation comes back as soon as the batch shrinks. A request may lower its own
cap (``Sequence.num_speculative_tokens``).

``DEFAULT_SPEC_MAX_BATCH`` (10) comes from the break-even measured on this 2-core CPU with
qwen2.5-coder-1.5b and an int4 qwen2.5-coder-0.5b draft (K = 5, capped as above), served with
``--spec-max-batch 64`` and swept by ``python -m specdec.bench.load --speculation both --requests 24
--max-tokens 48 --chat-fraction 1 --concurrency 1,4,6,8,10,12,16``: each level runs the same greedy
requests with speculation off (per request) and on, on the same server. Output tokens/s, on vs off:
1.63x at 1, 1.19x at 4, 1.20x at 6, 1.11x at 8, 1.16x at 10, 1.00x at 12, 0.96x at 16.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specdec.engine import Engine
from specdec.runtime.sequence import Sequence
from specdec.server import DEFAULT_SPEC_MAX_BATCH
from specdec.server.metrics import Reported, ServerMetrics
from specdec.spec.adaptive import AdaptiveK, FixedK


@dataclass
class LoadAwareK:
    """Per-row draft length: the configured policy's, capped by batch size, 0 above ``spec_max_batch``."""

    base: FixedK | AdaptiveK
    spec_max_batch: int
    rows_budget: int = 16

    def cap(self, batch_size: int) -> int:
        if batch_size > self.spec_max_batch:
            return 0
        return max(1, self.rows_budget // max(batch_size, 1) - 1)

    def k_for(self, seq: Sequence, batch_size: int) -> int:
        return min(self.base.k_for(seq, batch_size), self.cap(batch_size))

    def update(self, seq: Sequence, drafted: int, accepted: int, seconds: float | None = None,
               batch_size: int = 1) -> None:
        self.base.update(seq, drafted, accepted, seconds, batch_size)

    def needs_plain_step(self, batch_size: int) -> bool:
        return self.base.needs_plain_step(batch_size)

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        self.base.observe_plain(batch_size, seconds)

    def forget(self, seq: Sequence) -> None:
        self.base.forget(seq)


@dataclass
class Event:
    """New text of choice ``index``; ``finish_reason`` set on its last event; ``error`` on failure."""

    index: int
    text: str
    finish_reason: str | None = None
    error: str | None = None


class RequestHandle:
    """One HTTP request's sequences (its choices) and the asyncio queue their events arrive on."""

    def __init__(self, seqs: list[Sequence], loop: asyncio.AbstractEventLoop) -> None:
        self.seqs = seqs
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False
        self.done = False

    def post(self, event: Event) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def events(self) -> AsyncIterator[Event]:
        """Events until every choice has finished (or an error event)."""
        left = len(self.seqs)
        while left:
            ev = await self.queue.get()
            if ev.error is not None or ev.finish_reason is not None:
                left = 0 if ev.error is not None else left - 1
            yield ev
        self.done = True

    def counts(self) -> tuple[int, int, int]:
        """(completion tokens, drafted tokens, accepted draft tokens) over all choices."""
        return (sum(len(s.output_ids) for s in self.seqs), sum(s.num_draft for s in self.seqs),
                sum(s.num_accepted for s in self.seqs))


@dataclass
class _Track:
    """A sequence in flight: where its events go and what was already sent and counted."""

    seq: Sequence
    handle: RequestHandle
    index: int
    sent: int = 0  # characters of seq.text already sent
    ttft_seen: bool = False
    rep: Reported = field(default_factory=Reported)


class Scheduler:
    """Owns the engine thread; ``submit`` / ``cancel`` are called from the event loop."""

    def __init__(self, llm, metrics: ServerMetrics, max_batch_size: int = 16,
                 spec_max_batch: int = DEFAULT_SPEC_MAX_BATCH, rows_budget: int = 16) -> None:
        self.llm, self.metrics, self.max_batch_size = llm, metrics, max_batch_size
        proposer = llm.proposer if llm.num_speculative_tokens > 0 else None
        self.k = llm.num_speculative_tokens if proposer is not None else 0
        cache = llm.runner.ensure_cache(max_batch_size, llm.max_model_len + self.k + 1)
        if proposer is not None:
            proposer.prepare(cache.rows, cache.max_len)
        base = AdaptiveK(self.k) if llm.adaptive else FixedK(self.k)
        self.policy = LoadAwareK(base, spec_max_batch, rows_budget)
        self.engine = Engine(llm.runner, proposer, self.policy)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Track] = collections.deque()
        self._cancels: list[RequestHandle] = []
        self._active: dict[str, _Track] = {}  # request_id -> track, for running sequences
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    def submit(self, seqs: list[Sequence], loop: asyncio.AbstractEventLoop) -> RequestHandle:
        handle = RequestHandle(seqs, loop)
        with self._cond:
            self._waiting.extend(_Track(s, handle, i) for i, s in enumerate(seqs))
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Drop a request's sequences: waiting ones now, running ones before the next step."""
        with self._cond:
            if handle.cancelled or handle.done:
                return
            handle.cancelled = True
            self._waiting = collections.deque(t for t in self._waiting if t.handle is not handle)
            self.metrics.waiting.set(len(self._waiting))
            self._cancels.append(handle)
            self._cond.notify()

    # ---- engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._waiting or self._cancels or self.engine.running):
                    self._cond.wait()
                if self._stop:
                    break
                cancels, self._cancels = self._cancels, []
            for h in cancels:
                for s in h.seqs:
                    if s.request_id in self._active:
                        self._drop(self._active.pop(s.request_id))
            with self._cond:
                free = self.max_batch_size - len(self.engine.running)
                admit = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                self.metrics.waiting.set(len(self._waiting))
            try:
                for t in admit:
                    self._admit(t)
                if self.engine.running:
                    self._step()
            except Exception as e:  # a bug: fail what runs, keep serving
                logging.getLogger(__name__).exception("engine step failed")
                self._fail_all(f"internal error in the engine: {type(e).__name__}: {e}")
            self.metrics.running.set(len(self.engine.running))
        self._fail_all("the server is shutting down", waiting_too=True)

    def _admit(self, t: _Track) -> None:
        self._active[t.seq.request_id] = t
        self.engine.add(t.seq)
        self.metrics.prompt_tokens.inc(len(t.seq.prompt_ids))

    def _step(self) -> None:
        B = len(self.engine.running)
        self.metrics.k_cap.set(min(self.k, self.policy.cap(B)))
        stepped = self.engine.step()
        self.metrics.steps.inc()
        for seq in stepped:
            t = self._active[seq.request_id]
            self.metrics.observe_step(seq, t.rep)
            if not t.ttft_seen and seq.t_first is not None:
                t.ttft_seen = True
                self.metrics.ttft.observe(seq.t_first - seq.t_start)
            self._publish(t)
            if seq.finished:
                del self._active[seq.request_id]
                self.metrics.observe_finished(seq)

    def _publish(self, t: _Track) -> None:
        seq = t.seq
        end = len(seq.text)
        if not seq.finished and seq.params.stop:
            end -= max(len(s) for s in seq.params.stop) - 1  # a stop string may still be forming
        delta = seq.text[t.sent:end] if end > t.sent else ""
        t.sent += len(delta)
        if delta or seq.finished:
            t.handle.post(Event(t.index, delta, seq.finish_reason if seq.finished else None))

    def _drop(self, t: _Track, error: str | None = None) -> None:
        try:
            self.engine.cancel(t.seq)
            self.metrics.observe_finished(t.seq)
        finally:  # whatever state the engine is in, the request gets its last event
            t.handle.post(Event(t.index, "", "abort", error=error))

    def _fail_all(self, message: str, waiting_too: bool = False) -> None:
        """End the running sequences (and the waiting ones: ``waiting_too``) with an error event."""
        with self._cond:
            tracks = list(self._active.values()) + (list(self._waiting) if waiting_too else [])
            if waiting_too:
                self._waiting.clear()
        self._active.clear()
        for t in tracks:
            try:
                self._drop(t, error=message)
            except Exception:
                logging.getLogger(__name__).exception("cancelling a sequence failed")
        self.engine.running = []
