"""The engine deployment: one replica = one single-process server's app, with its engine thread.

``Engine.forward`` answers a request the ingress forwards by running it through the app built by
``specdec.server.app.build_app`` from the same flags as ``specdec serve`` (``relay.py``): protocol,
validation, continuous batching, speculation and its batch cut-off (``--spec-max-batch``) all work
per replica exactly as in the single server. Ray Serve calls ``check_health`` every few seconds: it
fails when the engine thread died or stopped making progress (``Scheduler.health``), and Serve then
replaces the replica. A dead engine thread does not wait for that: Serve needs three failed checks
(15 s) and then a drain of ``--drain-timeout`` seconds before it replaces a replica, and meanwhile
the requests on it would hang and the router would keep sending it new ones (their conversations'
first choice). So a watchdog ends the replica's process within ``ENGINE_WATCH_S`` of the thread's
death: the ingress resends the requests that had not begun answering, streams under way end with
their error event, the router drops the replica at once, and Serve starts a new one. On scale-down
or shutdown Serve stops routing to the replica, waits for its ongoing requests (up to
``--drain-timeout``), then calls ``__del__``, which stops the engine thread.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

from ray import serve

from specdec.server.cluster.metrics import PUSH_PERIOD_S
from specdec.server.cluster.relay import REPLICA_HEADER, HTTPCall, call_asgi

log = logging.getLogger("specdec.cluster")
ENGINE_WATCH_S = 0.5  # how often the watchdog looks at the engine thread


def exit_replica(why: str) -> None:
    """End this replica's process at once (its engine thread is gone): Ray reports the actor dead."""
    log.error("%s: ending the replica's process so that Ray Serve replaces it", why)
    logging.shutdown()
    os._exit(70)


class Engine:
    """A Ray Serve deployment class (``deployments()`` applies the options)."""

    async def __init__(self, args: argparse.Namespace, board=None) -> None:
        from specdec.server.app import build_app  # noqa: PLC0415 (torch: only in engine replicas)

        self.app, self.llm, _ = build_app(args)
        self.scheduler = self.app.state.scheduler
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine thread
        self.name = serve.get_replica_context().replica_id.unique_id
        self.board = board
        self._pusher = asyncio.ensure_future(self._push_metrics()) if board is not None else None
        self._watchdog = asyncio.ensure_future(self._watch_engine())

    async def forward(self, call: HTTPCall, route_key: str | None = None,
                      avoid: tuple[str, ...] = ()) -> AsyncIterator[dict]:
        """The app's response messages for ``call``, its start naming this replica (``REPLICA_HEADER``:
        the ingress resends a 503 elsewhere); ``route_key`` and ``avoid`` are read by the router only."""
        async for message in call_asgi(self.app, call):
            if message.get("type") == "http.response.start":
                message = message | {"headers": [*message.get("headers", ()), (REPLICA_HEADER, self.name.encode())]}
            yield message

    def check_health(self) -> None:
        ok, why = self.scheduler.health()
        if not ok:
            raise RuntimeError(f"replica {self.name}: {why}")

    async def _watch_engine(self) -> None:
        while self.scheduler.engine_alive() or self.scheduler.draining:
            await asyncio.sleep(ENGINE_WATCH_S)
        exit_replica(f"replica {self.name}: the engine thread died")

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.name, self.app.state.metrics.render().decode())
            except Exception as e:  # noqa: BLE001 (the board restarting must not end the pushes)
                log.warning("metrics push failed: %s", e)
            await asyncio.sleep(PUSH_PERIOD_S)

    async def __del__(self) -> None:
        self.scheduler.draining = True
        for task in (self._watchdog, self._pusher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._lifespan.__aexit__(None, None, None)
