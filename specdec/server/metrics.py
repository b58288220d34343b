"""Prometheus metrics of one server, named like vLLM's (``specdec:`` instead of ``vllm:``).

Each ``ServerMetrics`` owns its registry (no process-wide default registry), so two servers in one
process, as in tests, do not collide. ``process_resident_memory_bytes`` comes from the standard
process collector and lets a load test see memory return to its idle level.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specdec.runtime.sequence import Sequence

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


@dataclass
class Reported:
    """What the metrics have already counted of one sequence."""

    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    steps: int = 0
    t_last: float | None = None  # when the sequence last received tokens (perf_counter)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        self.requests = Counter("specdec:http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("specdec:e2e_request_latency_seconds", "HTTP request latency, to the last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specdec:time_to_first_token_seconds", "arrival to first generated token, "
                              "per sequence", buckets=TOKEN_BUCKETS + LATENCY_BUCKETS[6:], registry=r)
        self.tpot = Histogram("specdec:time_per_output_token_seconds", "decode time per output token after "
                              "the first, per sequence", buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specdec:prompt_tokens", "prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter("specdec:generation_tokens", "generated tokens", registry=r)
        self.finished = Counter("specdec:request_success", "finished sequences by finish reason "
                                "(abort: cancelled, e.g. the client went away)", ["finished_reason"], registry=r)
        self.num_drafts = Counter("specdec:spec_decode_num_drafts", "steps in which a sequence drafted", registry=r)
        self.draft_tokens = Counter("specdec:spec_decode_num_draft_tokens", "drafted tokens", registry=r)
        self.accepted_tokens = Counter("specdec:spec_decode_num_accepted_tokens", "accepted draft tokens",
                                       registry=r)
        self.accepted_per_pos = Counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                                        "accepted draft tokens by draft position (0 = first)", ["position"],
                                        registry=r)
        self.drafted_per_pos = Counter("specdec:spec_decode_num_draft_tokens_per_pos",
                                       "drafted tokens by draft position (0 = first)", ["position"], registry=r)
        self.running = Gauge("specdec:num_requests_running", "sequences in the running batch", registry=r)
        self.waiting = Gauge("specdec:num_requests_waiting", "sequences waiting for a cache row", registry=r)
        self.k_cap = Gauge("specdec:spec_decode_k_cap", "draft length the current load allows "
                           "(0: speculation off at this batch size)", registry=r)
        self.spec_off = Counter("specdec:spec_decode_off_steps", "engine steps without speculation, by why: "
                                "load (the batch is past --spec-max-batch), cost (verifying a block would cost "
                                "more than its expected tokens save) or length (a step in which a row's context "
                                "made its block too dear: that row decoded plainly, others may have drafted)",
                                ["reason"], registry=r)
        self.steps = Counter("specdec:engine_steps", "engine steps (one target forward each)", registry=r)
        self.steps_by_batch = Counter("specdec:engine_steps_by_batch_size", "engine steps by batch size and "
                                      "whether the load allowed speculation (on: K cap > 0)",
                                      ["batch_size", "speculation"], registry=r)
        self.step_draft = Histogram("specdec:step_draft_seconds", "drafting time of one engine step (the "
                                    "whole batch's drafts)", buckets=STEP_BUCKETS, registry=r)
        self.step_verify = Histogram("specdec:step_verify_seconds", "verification time of one engine step "
                                     "(the target's forward over the batch's drafts)", buckets=STEP_BUCKETS,
                                     registry=r)
        self.decode_steps = Counter("specdec:spec_decode_num_steps", "target steps that decoded for a sequence "
                                    "(after its prefill); tokens per step = (accepted + steps) / steps",
                                    registry=r)
        self.itl = Histogram("specdec:inter_token_latency_seconds", "time between a sequence's successive "
                             "outputs divided by the tokens the later one carried (one sample per token)",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.restarts = Counter("specdec:engine_restarts", "engine cores replaced after an error of the "
                                "engine itself (what was in flight failed with a retryable 503)", registry=r)
        self.rejected = Counter("specdec:requests_rejected", "requests refused by overload control (429) or "
                                "shutdown (503)", ["reason"], registry=r)

        self.kv_usage = Gauge("specdec:kv_cache_usage_perc", "fraction of the target's KV cache blocks in use "
                              "(1 = full; cached prefix blocks nobody holds count as free)", registry=r)
        self.kv_blocks_used = Gauge("specdec:kv_cache_blocks_used", "KV cache blocks held by requests", registry=r)
        self.kv_blocks_free = Gauge("specdec:kv_cache_blocks_free", "KV cache blocks free (empty or cached)",
                                    registry=r)
        self.prefix_queries = Counter("specdec:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("specdec:prefix_cache_hits", "prompt tokens found in the prefix cache (not "
                                   "prefilled again)", registry=r)
        self.preemptions = Counter("specdec:num_preemptions", "requests preempted for lack of KV cache blocks "
                                   "(their blocks freed, prefilled again later)", registry=r)
        self._seen = [0, 0, 0]  # the cache's queries and hits, the engine's preemptions, last counted
        self._times, self._times_of = (0.0, 0.0), None  # the engine's draft and verify seconds, last counted

    def observe_engine_step(self, batch_size: int, k_cap: int, times, off_reason: str | None = "load") -> None:
        """One engine step over ``batch_size`` rows, speculation allowed up to ``k_cap`` (0: off, for
        ``off_reason``, None: a server without a drafter); ``times``: the engine's cumulative ``StepTimes`` (an engine restarted after an
        error brings a new one)."""
        self.steps.inc()
        if k_cap == 0 and off_reason:
            self.spec_off.labels(reason=off_reason).inc()
        self.steps_by_batch.labels(batch_size=str(batch_size), speculation="on" if k_cap > 0 else "off").inc()
        old_d, old_v = self._times if times is self._times_of else (0.0, 0.0)  # a new engine counts from 0
        self.step_draft.observe(max(times.draft - old_d, 0.0))
        self.step_verify.observe(max(times.verify - old_v, 0.0))
        self._times, self._times_of = (times.draft, times.verify), times

    def observe_cache(self, queries: int, hits: int, preemptions: int, used: int, free: int) -> None:
        """The target cache's state and counters after a step (counters that restarted count from 0)."""
        for counter, i, now in ((self.prefix_queries, 0, queries), (self.prefix_hits, 1, hits),
                                (self.preemptions, 2, preemptions)):
            counter.inc(now - self._seen[i] if now >= self._seen[i] else now)
            self._seen[i] = now
        self.kv_blocks_used.set(used)
        self.kv_blocks_free.set(free)
        self.kv_usage.set(used / max(used + free, 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_step(self, seq: Sequence, rep: Reported, now: float | None = None) -> None:
        """Count what ``seq`` generated, drafted and accepted since ``rep`` (at ``now``, default the
        clock), then update ``rep``."""
        now = time.perf_counter() if now is None else now
        new = len(seq.output_ids) - rep.generated
        self.generation_tokens.inc(new)
        if new > 0:
            if rep.t_last is not None:  # a draft of several accepted tokens: several short gaps
                for _ in range(new):
                    self.itl.observe((now - rep.t_last) / new)
            rep.t_last = now
        self.decode_steps.inc(max(seq.num_steps - rep.steps, 0))
        if seq.num_draft > rep.drafted:
            self.num_drafts.inc()
            self.draft_tokens.inc(seq.num_draft - rep.drafted)
        self.accepted_tokens.inc(seq.num_accepted - rep.accepted)
        for j, (d, a) in enumerate(zip(seq.drafted_at, seq.accepted_at)):
            old_d, old_a = (rep.drafted_at[j], rep.accepted_at[j]) if j < len(rep.drafted_at) else (0, 0)
            if d > old_d:
                self.drafted_per_pos.labels(position=str(j)).inc(d - old_d)
            if a > old_a:
                self.accepted_per_pos.labels(position=str(j)).inc(a - old_a)
        rep.generated, rep.drafted, rep.accepted = len(seq.output_ids), seq.num_draft, seq.num_accepted
        rep.steps = seq.num_steps
        rep.drafted_at, rep.accepted_at = list(seq.drafted_at), list(seq.accepted_at)

    def observe_finished(self, seq: Sequence) -> None:
        self.finished.labels(finished_reason=seq.finish_reason or "abort").inc()
        n = len(seq.output_ids)
        if seq.t_first is not None and seq.t_end is not None and n > 1:
            self.tpot.observe((seq.t_end - seq.t_first) / (n - 1))
