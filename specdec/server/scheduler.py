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

Faults. An error raised by one request's own work (``StepResult.failed``: its admission, prefill or
proposer state) fails that request alone, with an error event (HTTP 500 semantics). An error in
the batched step is retried row by row (``EngineCore.step_each``): rows whose own step raises fail
alone and the others go on. The engine itself counts as broken, and restarts, when every row of a
step of several rows fails alone, or when ``restart_after`` requests in a row failed in the engine
with no step going well between them (at concurrency 1 a broken engine fails one request at a time,
which alone proves nothing). A restart fails every request in flight with a retryable error (503)
and rebuilds the runner, its KV cache and block pool, and the proposer from the loaded weights
(``LLM.reset_runtime``): a corrupted cache or proposer does not survive it. A restart that fails
leaves no engine: requests get 503 with Retry-After and the thread tries again with a growing pause.
An error while dropping a cancelled request is logged and the request still gets its last event.
If the thread itself dies, what is in flight gets a 503 event and ``submit`` answers 503 at once.

Health. The thread stamps ``beat`` on every iteration. ``health`` is false (``/health``: 503) when the
thread is dead, when its beat is older than ``stale_after`` seconds (a hung step), when there is no
engine (a restart failed), or when ``max_restarts`` restarts in a row did not bring back one step that
goes well; ``/health`` also reports ``consecutive_failures`` (requests failed by the engine since the
last step that went well) and ``restarts``.

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

from specdec.engine.core import EngineCore
from specdec.runtime.sequence import Sequence
from specdec.server.flags import DEFAULT_SPEC_MAX_BATCH
from specdec.server.metrics import Reported, ServerMetrics
from specdec.server.protocol import APIError
from specdec.server.provenance import Provenance


@dataclass
class Event:
    """New text of choice ``index``; ``finish_reason`` set on its last event; ``error`` on failure,
    with the HTTP ``status`` it stands for (503: retryable, the engine restarted or stops)."""

    index: int
    text: str
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500
    provenance: dict | None = None  # the text's tokens and their sources (provenance.py), when asked


def too_many_sequences(count: int, limit: int) -> str:
    return (f"the request makes {count} sequences (prompts x n), more than the {limit} this server lets wait "
            "for a batch row at once (--max-waiting): split it into smaller requests")


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
    prov: Provenance | None = None  # the request asked for per-token provenance


class Scheduler:
    """Owns the engine thread; ``submit`` / ``cancel`` / ``health`` are called from the event loop.

    ``max_waiting``: sequences allowed to wait for a row, a new request's own counted (past it ``submit``
    answers 429; a request of more sequences than that alone, 400);
    ``max_prefill_tokens``: chunked prefill budget per step; ``stale_after``: seconds without a
    beat after which the engine thread counts as hung; ``recorder``: finished requests are recorded
    (``traffic.py``)."""

    def __init__(self, llm, metrics: ServerMetrics, max_batch_size: int = 16,
                 spec_max_batch: int = DEFAULT_SPEC_MAX_BATCH, rows_budget: int = 16, *,
                 max_waiting: int | None = None, max_prefill_tokens: int | None = None,
                 stale_after: float = 60.0, restart_after: int = 2, max_restarts: int = 3,
                 restart_backoff: float = 1.0, recorder=None) -> None:
        self.llm, self.metrics, self.max_batch_size = llm, metrics, max_batch_size
        self.recorder = recorder  # a TrafficRecorder (--record-traffic) or None
        self.max_waiting, self.stale_after = max_waiting, stale_after
        self.restart_after, self.max_restarts, self.restart_backoff = restart_after, max_restarts, restart_backoff
        self._engine_args = dict(spec_max_batch=spec_max_batch, max_num_seqs=max_batch_size,
                                 rows_budget=rows_budget, max_prefill_tokens=max_prefill_tokens)
        self.engine: EngineCore | None = self._new_engine()  # None: a restart failed (``broken``)
        self.policy, self.k = self.engine.policy, self.engine.k
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Track] = collections.deque()
        self._cancels: list[RequestHandle] = []
        self._active: dict[str, _Track] = {}  # request_id -> track, for sequences inside the core
        self._stop = False
        self.draining = False  # set on shutdown: no new requests
        self.beat = time.monotonic()
        self.restarts = 0
        self.failures = 0  # requests the engine failed since the last step that went well
        self._failures_since_restart = 0
        self.restarts_in_a_row = 0  # restarts since the last step that went well
        self.broken: str | None = None  # why the last restart failed (no engine until one succeeds)
        self.died: str | None = None  # why the engine thread ended with an error
        self._started = False
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    def _new_engine(self) -> EngineCore:
        engine = self.llm.engine(**self._engine_args)
        # every request fits the context: size the caches for a full batch of them once
        engine.reserve(self.max_batch_size, engine.slots_for(self.llm.max_model_len))
        return engine

    # ---- event-loop side ------------------------------------------------------------------
    def start(self) -> None:
        self._started = True
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = self.draining = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def engine_alive(self) -> bool:
        """Whether the engine thread runs (it ends on ``stop``, or when it dies of an error)."""
        return self._thread.is_alive() and self.died is None

    def health(self) -> tuple[bool, str]:
        """(healthy, why not): the engine thread runs, has beaten within ``stale_after`` seconds, has an
        engine, and restarting has not failed ``max_restarts`` times in a row to fix it."""
        if not self.engine_alive():
            return False, "the engine thread is not running" + (f" ({self.died})" if self.died else "")
        if self.broken is not None:
            return False, f"the engine failed and restarting it failed ({self.broken}); it tries again"
        if self.restarts_in_a_row >= self.max_restarts:
            return False, (f"the engine failed {self.failures} requests in a row; {self.restarts_in_a_row} restarts "
                           "did not help")
        age = time.monotonic() - self.beat
        if age > self.stale_after:
            return False, f"the engine thread has not made progress for {age:.0f} s"
        return True, ""

    def health_report(self) -> dict:
        """``/health``'s body: the verdict, why not, and the failure counters."""
        ok, why = self.health()
        return ({"status": "ok"} if ok else {"status": "unhealthy", "reason": why}) | {
            "consecutive_failures": self.failures, "restarts": self.restarts}

    def submit(self, seqs: list[Sequence], loop: asyncio.AbstractEventLoop, provenance: bool = False
               ) -> RequestHandle:
        """Queue a request's sequences; APIError 503 while shutting down or without a running engine,
        429 when they would take the waiting sequences past ``max_waiting``, 400 when they alone are
        more than that (a retry cannot help: each choice of each prompt is a sequence that waits).
        ``provenance``: its events carry each token's source (``provenance.py``)."""
        handle = RequestHandle(seqs, loop)
        with self._cond:
            if self.draining:
                raise APIError("the server is shutting down: send the request to another replica", 503,
                               "server_error", code="shutting_down", headers={"Retry-After": "1"})
            if self.died is not None or (self._started and not self._thread.is_alive()):
                raise APIError("the server's engine is not running: retry on another replica (this one needs a "
                               "restart)", 503, "server_error", code="engine_dead", headers={"Retry-After": "10"})
            if self.broken is not None:
                raise APIError(f"the server's engine failed and is restarting ({self.broken}): retry later", 503,
                               "server_error", code="engine_restarting", headers={"Retry-After": "5"})
            queued = len(self._waiting)
            if self.max_waiting is not None and len(seqs) > self.max_waiting:  # it could never wait whole
                raise APIError(too_many_sequences(len(seqs), self.max_waiting), param="n",
                               code="too_many_sequences")
            if self.max_waiting is not None and queued + len(seqs) > self.max_waiting:
                raise APIError(f"the server is overloaded ({queued} sequences wait for a slot, at most "
                               f"{self.max_waiting}): retry later", 429, "rate_limit_error",
                               code="too_many_waiting", headers={"Retry-After": str(self._retry_after())})
            self._waiting.extend(_Track(s, handle, i, prov=self._provenance(s) if provenance else None)
                                 for i, s in enumerate(seqs))
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()
        return handle

    def _provenance(self, seq: Sequence) -> Provenance:
        cap = self.k if seq.num_speculative_tokens is None else min(self.k, seq.num_speculative_tokens)
        return Provenance(self.llm.tokenizer, cap)

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
    def _run(self) -> None:
        """The thread's body: the loop; should it die of an error, what is in flight gets a 503."""
        try:
            self._loop()
        except BaseException as e:
            with self._cond:
                self.died = f"{type(e).__name__}: {e}"
            logging.getLogger(__name__).critical("the engine thread died", exc_info=True)
            self._fail_all("the server's engine died: retry the request on another replica")
            raise

    def _has_work(self) -> bool:
        return self.engine is not None and self.engine.has_work()

    def _loop(self) -> None:
        log = logging.getLogger(__name__)
        pause = self.restart_backoff
        while True:
            self.beat = time.monotonic()
            with self._cond:
                while not (self._stop or self._waiting or self._cancels or self._has_work() or self.engine is None):
                    self._cond.wait(1.0)
                    self.beat = time.monotonic()
                if self._stop:
                    break
                cancels, self._cancels = self._cancels, []
            if self.engine is None:  # the last restart failed: try again after a pause
                self.metrics.running.set(0)
                with self._cond:
                    if not self._stop:
                        self._cond.wait(pause)
                pause = min(2 * pause, 30.0) if not self._rebuild() else self.restart_backoff
                continue
            try:
                self._cancel(cancels)
                self._admit()
                if self.engine.has_work():
                    self._step()
            except Exception as e:  # noqa: BLE001 (a bug of the engine itself: restart it)
                log.exception("engine error: restarting the engine")
                self._restart(f"the engine failed ({type(e).__name__}: {e}) and restarted: retry the request")
            if self.engine is not None:
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

    def _why_off(self, seq, cap: int, off: str | None, batch: int) -> str | None:
        """Why ``seq`` drafted nothing this step, in words (None: it could draft; a server without a
        drafter says so once, in its model card)."""
        if not self.k:
            return None
        if seq.num_speculative_tokens == 0:
            return "the request asked for no drafts"
        if cap > 0:  # the batch could draft; this row's own context may make its block too dear
            return getattr(self.policy, "row_off", {}).get(seq.request_id)
        if off == "cost":
            return f"a block of drafts costs more than it saves: {self.policy.reason}"
        return f"{batch} sequences running: past the batch size speculation runs at (--spec-max-batch)"

    def _step(self) -> None:
        B = min(len(self.engine.in_flight()), self.max_batch_size)
        cap = min(self.k, self.policy.cap(B)) if self.k else 0
        self.metrics.k_cap.set(cap)
        result = self.engine.step()  # never raises: what it stepped, what failed, the batched error
        stepped = result.stepped
        if result.failed and not stepped and result.error is None:  # requests' own work, nothing else ran
            self._failed_alone(result.failed)
            return
        for seq, err in result.failed:  # one request's own work: it alone fails
            logging.getLogger(__name__).error("request %s failed", seq.request_id, exc_info=err)
            self._fail(seq, f"the request failed in the engine: {type(err).__name__}: {err}")
        if result.error is not None:  # find the row that raises: step the rows one at a time
            logging.getLogger(__name__).error("engine step failed: retrying the rows one at a time",
                                              exc_info=result.error)
            before = len(self.engine.running)
            stepped, failed = self.engine.step_each()
            if failed and len(failed) == before and before > 1:
                self.failures += len(failed)
                raise failed[0][1]  # every row fails alone: the engine is broken (``_restart``)
            if failed and not stepped:
                self._failed_alone(failed)
                return
            for seq, err in failed:
                self._fail(seq, f"the request failed in the engine: {type(err).__name__}: {err}")
        if stepped:  # a step went well: the engine works
            self.failures = self._failures_since_restart = self.restarts_in_a_row = 0
        off = None if not self.k else ("cost" if cap == 0 and getattr(self.policy, "reason", None) else "load")
        self.metrics.observe_engine_step(B, cap, self.engine.times, off)
        for seq in stepped:
            seq.spec_off = self._why_off(seq, cap, off, B)
        if cap > 0 and any(s.request_id in getattr(self.policy, "row_off", {}) for s in stepped):
            self.metrics.spec_off.labels(reason="length").inc()  # a row plain for its context's length
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
            end -= seq.stop_len - 1  # a stop string may still be forming
        delta = seq.text[t.sent:end] if end > t.sent else ""
        t.sent += len(delta)
        prov = None
        if t.prov is not None:
            t.prov.observe(seq)
            prov = t.prov.chunk_field(seq, t.sent) if delta or seq.finished else None
        if delta or seq.finished:
            t.handle.post(Event(t.index, delta, seq.finish_reason if seq.finished else None, provenance=prov))

    def _fail(self, seq: Sequence, message: str) -> None:
        """``seq`` failed (the core has dropped it): its request ends with an error event."""
        t = self._active.pop(seq.request_id, None)
        if t is not None:
            self.metrics.observe_finished(seq)
            t.handle.post(Event(t.index, "", "abort", error=message, status=500))

    def _drop(self, t: _Track, error: str | None = None, status: int = 500) -> None:
        """Abort ``t``'s sequence in the core; whatever raises, the request gets its last event."""
        try:
            if self.engine is not None:
                self.engine.abort(t.seq)
        except Exception:  # noqa: BLE001 (the cancellation path must not end the engine thread)
            logging.getLogger(__name__).exception("aborting a sequence failed")
        finally:
            if not t.seq.finished:
                t.seq.finish("abort", None)
            self.metrics.observe_finished(t.seq)
            t.handle.post(Event(t.index, "", "abort", error=error, status=status))

    def _failed_alone(self, failed: list[tuple[Sequence, BaseException]]) -> None:
        """Requests the engine failed (the core has dropped them) while none stepped: each gets a 500,
        unless they make ``restart_after`` in a row; then the engine restarts and they, with everything
        in flight, get a 503 (retryable)."""
        self.failures += len(failed)
        self._failures_since_restart += len(failed)
        if self._failures_since_restart >= self.restart_after:
            err = failed[-1][1]
            self._restart(f"the engine failed {self._failures_since_restart} requests in a row ({type(err).__name__}: "
                          f"{err}) and restarted: retry the request")
            return
        for seq, err in failed:
            self._fail(seq, f"the request failed in the engine: {type(err).__name__}: {err}")

    def _restart(self, message: str) -> None:
        """The engine is broken: start afresh (a new runner, KV cache and proposer over the loaded weights,
        and a new core; none while that fails: ``broken``), then fail what was in flight (retryable):
        a client retrying at once finds the new engine, or a 503 saying the restart failed."""
        self.restarts += 1
        self.restarts_in_a_row += 1
        self._failures_since_restart = 0
        self.metrics.restarts.inc()
        tracks = self._take_all(waiting_too=False)
        self.engine = None  # the broken core and, with it, the old runner and proposer go (no abort: all is new)
        if not self._rebuild():
            message = f"the server's engine failed and could not be restarted ({self.broken}): retry later"
        for t in tracks:
            self._drop(t, error=message, status=503)

    def _rebuild(self) -> bool:
        """A fresh runtime and core; on failure ``broken`` says why and the waiting requests get a 503."""
        try:
            self.llm.reset_runtime()
            engine = self._new_engine()
        except Exception as e:  # noqa: BLE001 (no engine: requests get 503 until a retry succeeds)
            logging.getLogger(__name__).exception("restarting the engine failed")
            with self._cond:
                self.broken = f"{type(e).__name__}: {e}"
            self._fail_all(f"the server's engine failed and could not be restarted ({self.broken}): retry later")
            return False
        with self._cond:
            self.engine, self.policy, self.broken = engine, engine.policy, None
        return True

    def _take_all(self, waiting_too: bool = True) -> list[_Track]:
        """Take the sequences in the core (and the waiting ones: ``waiting_too``) off the books."""
        with self._cond:
            tracks = list(self._active.values()) + (list(self._waiting) if waiting_too else [])
            if waiting_too:
                self._waiting.clear()
                self.metrics.waiting.set(0)
        self._active.clear()
        return tracks

    def _fail_all(self, message: str, waiting_too: bool = True) -> None:
        """End the sequences in the core (and the waiting ones: ``waiting_too``) with a retryable error."""
        for t in self._take_all(waiting_too):
            self._drop(t, error=message, status=503)
        if self.engine is not None:
            self.engine.waiting, self.engine.prefilling, self.engine.running = collections.deque(), [], []
