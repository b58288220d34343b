"""The server's engine thread: continuous batching with load-aware speculation, isolating faults.

Design
------
One background thread owns the model, its KV cache (``max_batch_size`` rows x ``max_model_len``
positions plus room for a draft) and one ``EngineCore``. The asyncio side never touches them: a request
handler builds its ``Sequence`` objects (one per choice), hands them to ``submit`` and reads
``Event`` objects from its ``RequestHandle``'s asyncio queue. The thread loops:

1. take the pending cancellations and drop those sequences (``EngineCore.abort``: the cache row, the
   proposer's state and the draft-length policy's state are freed at once);
2. move waiting sequences, oldest first, into the core while it has free rows (the core admits them:
   with ``max_prefill_tokens`` a long prompt is prefilled a chunk per step, between decode steps, so
   running streams keep their pace);
3. run one ``EngineCore.step`` (prefill chunk, then propose -> verify -> accept over the running batch);
4. send each sequence's new text to its request (``loop.call_soon_threadsafe``), holding back the
   last ``len(longest stop string) - 1`` characters while a stop string may still be forming, and
   a final event when it finishes; finished sequences have already left the batch.

When nothing runs or waits the thread sleeps on a condition variable (waking each second to beat).

Faults. An error raised by one request's own work (``RequestFailed``: its admission, prefill or
proposer state) fails that request alone, with an error event (HTTP 500 semantics). An error in
the batched step is retried row by row (``EngineCore.step_each``): rows whose own step raises fail
alone and the others go on; when every row fails alone, the engine itself is broken: every request
in flight fails with a retryable error (503) and a fresh engine core replaces the old one. An
error while dropping a cancelled request is logged and the request still gets its last event. The
thread stamps ``beat`` on every iteration; ``health`` is false when the thread is dead or its
beat is older than ``stale_after`` seconds (a hung step), which ``/health`` answers with a 503.

Speculation adapts to load (``engine.policies.LoadAwareK``): a step verifies B x (K + 1) tokens, and on this CPU a
forward over T tokens costs about one token's up to T = 4, 1.2x at 8 and 1.55x at 16 (BENCHMARKS.md),
so K is capped at ``rows_budget // B - 1`` (at least 1), and above ``spec_max_batch`` sequences no draft
is made at all; speculation comes back as soon as the batch shrinks. A request may lower its own
cap (``Sequence.num_speculative_tokens``).

``DEFAULT_SPEC_MAX_BATCH`` (10) comes from the break-even measured on this 2-core CPU with
qwen2.5-coder-1.5b and an int4 qwen2.5-coder-0.5b draft (K = 5, capped as above), served with
``--spec-max-batch 64`` and swept by ``python -m specdec.tools.bench.load --speculation both --requests 24
--max-tokens 48 --chat-fraction 1 --concurrency 1,4,6,8,10,12,16``: each level runs the same greedy
requests with speculation off (per request) and on, on the same server. Output tokens/s, on vs off:
1.63x at 1, 1.19x at 4, 1.20x at 6, 1.11x at 8, 1.16x at 10, 1.00x at 12, 0.96x at 16.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from specdec.engine.core import EngineCore, RequestFailed
from specdec.runtime.sequence import Sequence
from specdec.server.flags import DEFAULT_SPEC_MAX_BATCH
from specdec.server.metrics import Reported, ServerMetrics
from specdec.server.protocol import APIError


@dataclass
class Event:
    """New text of choice ``index``; ``finish_reason`` set on its last event; ``error`` on failure,
    with the HTTP ``status`` it stands for (503: retryable, the engine restarted or stops)."""

    index: int
    text: str
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500


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

    async def events(self, deadline: float | None = None) -> AsyncIterator[Event]:
        """Events until every choice has finished (or an error event); past ``deadline``
        (``time.monotonic()``) an APIError 408 (the caller cancels the request)."""
        left = len(self.seqs)
        while left:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ev = await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                raise APIError("the request timed out (the server's --request-timeout) before it finished: "
                               "retry later or ask for fewer tokens", 408, "timeout_error",
                               code="request_timeout") from None
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
    """Owns the engine thread; ``submit`` / ``cancel`` / ``health`` are called from the event loop.

    ``max_waiting``: sequences allowed to wait for a row (past it ``submit`` answers 429);
    ``max_prefill_tokens``: chunked prefill budget per step; ``stale_after``: seconds without a
    beat after which the engine thread counts as hung; ``recorder``: finished requests are recorded
    (``traffic.py``)."""

    def __init__(self, llm, metrics: ServerMetrics, max_batch_size: int = 16,
                 spec_max_batch: int = DEFAULT_SPEC_MAX_BATCH, rows_budget: int = 16, *,
                 max_waiting: int | None = None, max_prefill_tokens: int | None = None,
                 stale_after: float = 60.0, recorder=None) -> None:
        self.llm, self.metrics, self.max_batch_size = llm, metrics, max_batch_size
        self.recorder = recorder  # a TrafficRecorder (--record-traffic) or None
        self.max_waiting, self.stale_after = max_waiting, stale_after
        self._engine_args = dict(spec_max_batch=spec_max_batch, max_num_seqs=max_batch_size,
                                 rows_budget=rows_budget, max_prefill_tokens=max_prefill_tokens)
        self.engine = self._new_engine()
        self.policy, self.k = self.engine.policy, self.engine.k
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Track] = collections.deque()
        self._cancels: list[RequestHandle] = []
        self._active: dict[str, _Track] = {}  # request_id -> track, for sequences inside the core
        self._stop = False
        self.draining = False  # set on shutdown: no new requests
        self.beat = time.monotonic()
        self.restarts = 0
        self._thread = threading.Thread(target=self._loop, name="specdec-engine", daemon=True)

    def _new_engine(self) -> EngineCore:
        engine = self.llm.engine(**self._engine_args)
        # every request fits the context: size the caches for a full batch of them once
        engine.reserve(self.max_batch_size, engine.slots_for(self.llm.max_model_len))
        return engine

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = self.draining = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def engine_alive(self) -> bool:
        """Whether the engine thread runs (it ends on ``stop``, or when restarting a failed engine failed)."""
        return self._thread.is_alive()

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): the engine thread runs and has beaten within ``stale_after`` seconds."""
        if not self.engine_alive():
            return False, "the engine thread is not running"
        age = time.monotonic() - self.beat
        if age > self.stale_after:
            return False, f"the engine thread has not made progress for {age:.0f} s"
        return True, ""

    def submit(self, seqs: list[Sequence], loop: asyncio.AbstractEventLoop) -> RequestHandle:
        """Queue a request's sequences; APIError 503 while shutting down, 429 past ``max_waiting``."""
        handle = RequestHandle(seqs, loop)
        with self._cond:
            if self.draining:
                raise APIError("the server is shutting down: send the request to another replica", 503,
                               "server_error", code="shutting_down", headers={"Retry-After": "1"})
            queued = len(self._waiting)
            if self.max_waiting is not None and queued and queued + len(seqs) > self.max_waiting:
                raise APIError(f"the server is overloaded ({queued} sequences wait for a slot, at most "
                               f"{self.max_waiting}): retry later", 429, "rate_limit_error",
                               code="too_many_waiting", headers={"Retry-After": str(self._retry_after())})
            self._waiting.extend(_Track(s, handle, i) for i, s in enumerate(seqs))
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()
        return handle

    def _retry_after(self) -> int:
        """Seconds to suggest: about one batch's turn per full batch queued ahead."""
        return max(1, min(60, len(self._waiting) // max(1, self.max_batch_size)))

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
        log = logging.getLogger(__name__)
        while True:
            self.beat = time.monotonic()
            with self._cond:
                while not (self._stop or self._waiting or self._cancels or self.engine.has_work()):
                    self._cond.wait(1.0)
                    self.beat = time.monotonic()
                if self._stop:
                    break
                cancels, self._cancels = self._cancels, []
            try:
                self._cancel(cancels)
                self._admit()
                if self.engine.has_work():
                    self._step()
            except Exception as e:  # noqa: BLE001 (a bug of the engine itself: restart it)
                log.exception("engine error: restarting the engine")
                self._restart(f"the engine failed ({type(e).__name__}: {e}) and restarted: retry the request")
            self.metrics.running.set(len(self.engine.running))
            cache = self.engine.runner.cache
            if cache is not None:
                self.metrics.observe_cache(cache.queries, cache.hits, self.engine.num_preemptions,
                                           cache.pool.num_used, cache.pool.num_free)
        self._fail_all("the server is shutting down: retry the request on another replica")

    def _cancel(self, handles: list[RequestHandle]) -> None:
        for h in handles:
            for s in h.seqs:
                t = self._active.pop(s.request_id, None)
                if t is not None:
                    self._drop(t)

    def _admit(self) -> None:
        with self._cond:
            free = self.engine.num_free() - len(self.engine.waiting)
            admit = [self._waiting.popleft() for _ in range(min(max(free, 0), len(self._waiting)))]
            self.metrics.waiting.set(len(self._waiting))
        for t in admit:  # into the core's queue at once: nothing taken off our queue is orphaned
            self._active[t.seq.request_id] = t
            self.engine.add(t.seq)
            self.metrics.prompt_tokens.inc(len(t.seq.prompt_ids))

    def _step(self) -> None:
        B = min(len(self.engine.in_flight()), self.max_batch_size)
        self.metrics.k_cap.set(min(self.k, self.policy.cap(B)) if self.k else 0)
        try:
            stepped = self.engine.step()
        except RequestFailed as e:  # one request's own work: it alone fails
            logging.getLogger(__name__).error("request failed: %s", e, exc_info=e.cause)
            self._fail(e.seq, f"the request failed in the engine: {type(e.cause).__name__}: {e.cause}")
            return
        except Exception:  # noqa: BLE001 (find the row that raises: step the rows one at a time)
            logging.getLogger(__name__).exception("engine step failed: retrying the rows one at a time")
            before = len(self.engine.running)
            stepped, failed = self.engine.step_each()
            if failed and len(failed) == before and before > 1:
                raise failed[0][1]  # every row fails alone: the engine is broken (``_restart``)
            for seq, err in failed:
                self._fail(seq, f"the request failed in the engine: {type(err).__name__}: {err}")
        self.metrics.steps.inc()
        for seq in stepped:
            t = self._active.get(seq.request_id)
            if t is None:
                continue
            self.metrics.observe_step(seq, t.rep)
            if not t.ttft_seen and seq.t_first is not None:
                t.ttft_seen = True
                self.metrics.ttft.observe(seq.t_first - seq.t_start)
            self._publish(t)
            if seq.finished:
                del self._active[seq.request_id]
                self.metrics.observe_finished(seq)
                if self.recorder is not None:
                    self.recorder.record(seq)

    def _publish(self, t: _Track) -> None:
        seq = t.seq
        end = len(seq.text)
        if not seq.finished and seq.params.stop:
            end -= max(len(s) for s in seq.params.stop) - 1  # a stop string may still be forming
        delta = seq.text[t.sent:end] if end > t.sent else ""
        t.sent += len(delta)
        if delta or seq.finished:
            t.handle.post(Event(t.index, delta, seq.finish_reason if seq.finished else None))

    def _fail(self, seq: Sequence, message: str) -> None:
        """``seq`` failed (the core has dropped it): its request ends with an error event."""
        t = self._active.pop(seq.request_id, None)
        if t is not None:
            self.metrics.observe_finished(seq)
            t.handle.post(Event(t.index, "", "abort", error=message, status=500))

    def _drop(self, t: _Track, error: str | None = None, status: int = 500) -> None:
        """Abort ``t``'s sequence in the core; whatever raises, the request gets its last event."""
        try:
            self.engine.abort(t.seq)
        except Exception:  # noqa: BLE001 (the cancellation path must not end the engine thread)
            logging.getLogger(__name__).exception("aborting a sequence failed")
        finally:
            if not t.seq.finished:
                t.seq.finish("abort", None)
            self.metrics.observe_finished(t.seq)
            t.handle.post(Event(t.index, "", "abort", error=error, status=status))

    def _restart(self, message: str) -> None:
        """The engine is broken: fail what is in flight (retryable) and start a fresh core."""
        self.restarts += 1
        self.metrics.restarts.inc()
        self._fail_all(message, waiting_too=False)
        try:
            self.engine = self._new_engine()
            self.policy = self.engine.policy
        except Exception:  # noqa: BLE001 (keep the old core; the next step tells)
            logging.getLogger(__name__).exception("restarting the engine failed")

    def _fail_all(self, message: str, waiting_too: bool = True) -> None:
        """End the sequences in the core (and the waiting ones: ``waiting_too``) with a retryable error."""
        with self._cond:
            tracks = list(self._active.values()) + (list(self._waiting) if waiting_too else [])
            if waiting_too:
                self._waiting.clear()
                self.metrics.waiting.set(0)
        self._active.clear()
        for t in tracks:
            self._drop(t, error=message, status=503)
        self.engine.waiting, self.engine.prefilling, self.engine.running = collections.deque(), [], []
