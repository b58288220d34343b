"""Per-request metrics from a sequence, and acceptance statistics summed over many requests."""
from __future__ import annotations

import time
from collections.abc import Iterable

from specdec.outputs import RequestMetrics, RequestOutput
from specdec.runtime.sequence import Sequence


def aggregate(items: Iterable[RequestOutput | RequestMetrics]) -> RequestMetrics:
    """Sum the counters of many requests and recompute the rates from the sums.

    Times add up request by request, so for a batch run they count shared steps once per request;
    ``tokens_per_second`` is total generated tokens over the summed per-request time.
    """
    ms = [i.metrics if isinstance(i, RequestOutput) else i for i in items]
    out = RequestMetrics()
    width = max((len(m.num_drafted_by_position) for m in ms), default=0)
    drafted, accepted = [0] * width, [0] * width
    for m in ms:
        for f in ("num_prompt_tokens", "num_generated_tokens", "prefill_seconds", "decode_seconds",
                  "num_steps", "num_draft_tokens", "num_accepted_tokens", "draft_seconds",
                  "verify_seconds", "other_seconds"):
            setattr(out, f, getattr(out, f) + getattr(m, f))
        for i, (d, a) in enumerate(zip(m.num_drafted_by_position, m.num_accepted_by_position)):
            drafted[i] += d
            accepted[i] += a
    total = out.prefill_seconds + out.decode_seconds
    out.tokens_per_second = out.num_generated_tokens / total if total > 0 else 0.0
    decode_tokens = out.num_generated_tokens - sum(1 for m in ms if m.num_generated_tokens)
    out.decode_tokens_per_second = decode_tokens / out.decode_seconds if out.decode_seconds > 0 else 0.0
    out.acceptance_rate = out.num_accepted_tokens / out.num_draft_tokens if out.num_draft_tokens else 0.0
    # tokens emitted per step: a step cut inside its draft (EOS, a stop string) emitted no token of the target's own
    out.mean_accepted_length = out.num_generated_tokens / out.num_steps if out.num_steps else 0.0
    out.num_drafted_by_position, out.num_accepted_by_position = drafted, accepted
    out.acceptance_by_position = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
    return out


def sequence_metrics(seq: Sequence) -> RequestMetrics:
    """Per-request metrics from a finished (or running) sequence."""
    now = time.perf_counter()
    t_first = seq.t_first or now
    t_end = seq.t_end or now
    n = len(seq.output_ids)
    prefill = t_first - seq.t_start
    decode = max(t_end - t_first, 0.0)
    total = prefill + decode
    emitted = n / seq.num_steps if seq.num_steps else 0.0  # tokens per step (engine.accounting)
    return RequestMetrics(
        num_prompt_tokens=len(seq.prompt_ids), num_generated_tokens=n, prefill_seconds=prefill,
        decode_seconds=decode, tokens_per_second=n / total if total > 0 else 0.0,
        decode_tokens_per_second=(n - 1) / decode if decode > 0 and n > 1 else 0.0,
        num_steps=seq.num_steps, num_draft_tokens=seq.num_draft, num_accepted_tokens=seq.num_accepted,
        acceptance_rate=seq.num_accepted / seq.num_draft if seq.num_draft else 0.0,
        mean_accepted_length=float(emitted),
        acceptance_by_position=[a / d if d else 0.0 for a, d in zip(seq.accepted_at, seq.drafted_at)],
        num_drafted_by_position=list(seq.drafted_at), num_accepted_by_position=list(seq.accepted_at),
        draft_seconds=seq.draft_seconds, verify_seconds=seq.verify_seconds,
        other_seconds=max(total - seq.draft_seconds - seq.verify_seconds, 0.0),
    )
