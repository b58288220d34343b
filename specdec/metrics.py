"""Acceptance statistics over many requests."""
from __future__ import annotations

from collections.abc import Iterable

from specdec.outputs import RequestMetrics, RequestOutput


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
    out.mean_accepted_length = (out.num_accepted_tokens + out.num_steps) / out.num_steps if out.num_steps else 0.0
    out.num_drafted_by_position, out.num_accepted_by_position = drafted, accepted
    out.acceptance_by_position = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
    return out
