"""One /metrics for the whole application: every replica's Prometheus text, merged, with a
``replica`` label on each sample.

Each engine replica keeps the single server's ``ServerMetrics`` and pushes its rendered text to the
``MetricsBoard`` deployment (one replica) every ``PUSH_PERIOD_S`` seconds; the ingress answers
``GET /metrics`` with ``MetricsBoard.merged``, which adds its own counters (retries, failures seen
at the ingress). A replica that has stopped pushing for ``STALE_AFTER_S`` seconds (it died, or was
scaled down) drops out of the merge; its successor starts its counters from zero, which Prometheus'
``rate()`` reads as a counter reset. Ray's own metrics (``serve_*``: queue lengths, replica counts,
proxy latencies) stay on Ray's per-node metrics export port, as Ray documents.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

PUSH_PERIOD_S = 2.0
STALE_AFTER_S = 10.0


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus texts by replica name -> one text, samples labelled ``replica="<name>"``."""
    families: dict[str, object] = {}
    for replica, text in sorted(texts.items()):
        for fam in text_string_to_metric_families(text):
            merged = families.setdefault(fam.name, fam.__class__(fam.name, fam.documentation, fam.type, fam.unit))
            merged.samples.extend(s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)


class IngressMetrics:
    """What only the ingress sees: requests resent after a replica failed, and those it could not save."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.retries = Counter("specdec:replica_retries", "requests resent to another replica because theirs died "
                               "or was shutting down before it answered", registry=r)
        self.failed = Counter("specdec:replica_failures", "requests answered with a retryable error because their "
                              "replica died: after streaming had begun (an error event) or with every retry "
                              "spent (503)", ["stage"], registry=r)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class MetricsBoard:
    """The latest metrics text of each live replica (a Serve deployment with one replica)."""

    def __init__(self, stale_after: float = STALE_AFTER_S) -> None:
        self.stale_after = stale_after
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def merged(self, extra: dict[str, str] | None = None) -> bytes:
        """Every live replica's metrics plus ``extra`` (name -> text, e.g. the ingress's), merged."""
        now = time.monotonic()
        self.texts = {r: (t, text) for r, (t, text) in self.texts.items() if now - t <= self.stale_after}
        return merge_metrics({r: text for r, (_, text) in self.texts.items()} | (extra or {}))

    def replicas(self) -> list[str]:
        """The replicas that pushed within ``stale_after`` seconds."""
        now = time.monotonic()
        return sorted(r for r, (t, _) in self.texts.items() if now - t <= self.stale_after)
