"""The engine deployment's request router: prefix affinity, power-of-two choices on load.

Ray Serve's own prefix-aware router (``ray.serve.llm.request_router.PrefixCacheAffinityRouter``)
needs the ``ray[llm]`` extra (pyarrow and the vLLM-oriented configs) and a prefix-tree actor queried
with blocking calls on every request; this one is the small version: a request's route key (the
ingress passes ``route_key=``, see ``routing.py``) picks its first-choice replica by rendezvous
hashing, so a conversation's turns meet the cache rows and drafter state of the replica that served
the previous turn. When that replica holds more than ``imbalance`` requests over the least loaded
one (from Serve's queue-length cache), or is full, two random replicas compete on queue length, as in
Serve's default router. A request the ingress resends after a replica's 503 (``avoid=``: the replicas
that gave it) goes to the others while there are any.
"""
from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdec.server.cluster.routing import rank

DEFAULT_IMBALANCE = 4  # ongoing requests over the least loaded replica before affinity gives way


class PrefixAffinityRouter(RequestRouter):
    """Rank 1: the key's replica (unless overloaded); rank 2: two random others (queue length decides)."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs) -> None:
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        avoid = set(kwargs.get("avoid") or ())  # replicas that answered this request with a 503
        candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas
        if not candidate_replicas:
            return []
        key = kwargs.get("route_key")
        if key is None or len(candidate_replicas) == 1:
            return [_two(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        first = by_id[rank(key, list(by_id))[0]]
        lens = self.replica_queue_len_cache
        known = [q for q in (lens.get(r.replica_id) for r in candidate_replicas) if q is not None]
        if known and (lens.get(first.replica_id) or 0) - min(known) > self.imbalance:
            return [_two(candidate_replicas)]
        return [[first], _two([r for r in candidate_replicas if r is not first])]


def _two(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))
