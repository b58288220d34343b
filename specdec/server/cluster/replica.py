"""The engine deployment: one replica = one single-process server's app, with its engine thread.

``Engine.forward`` answers a request the ingress forwards by running it through the app built by
``specdec.server.build_app`` from the same flags as ``specdec serve`` (``relay.py``): protocol,
validation, continuous batching, speculation and its batch cut-off (``--spec-max-batch``) all work
per replica exactly as in the single server. Ray Serve calls ``check_health`` every few seconds: it
fails when the engine thread died or stopped making progress (``Scheduler.health``), and Serve then
replaces the replica. On scale-down or shutdown Serve stops routing to the replica, waits for its
ongoing requests (up to ``--drain-timeout``), then calls ``__del__``, which stops the engine thread.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from ray import serve

from specdec.server.cluster.metrics import PUSH_PERIOD_S
from specdec.server.cluster.relay import HTTPCall, call_asgi

log = logging.getLogger("specdec.cluster")


class Engine:
    """A Ray Serve deployment class (``deployments()`` applies the options)."""

    async def __init__(self, args: argparse.Namespace, board=None) -> None:
        from specdec.server import build_app  # noqa: PLC0415 (torch: only in engine replicas)

        self.app, self.llm, _ = build_app(args)
        self.scheduler = self.app.state.scheduler
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine thread
        self.name = serve.get_replica_context().replica_id.unique_id
        self.board = board
        self._pusher = asyncio.ensure_future(self._push_metrics()) if board is not None else None

    async def forward(self, call: HTTPCall, route_key: str | None = None) -> AsyncIterator[dict]:
        """The app's response messages for ``call`` (``route_key`` is read by the router only)."""
        async for message in call_asgi(self.app, call):
            yield message

    def check_health(self) -> None:
        ok, why = self.scheduler.health()
        if not ok:
            raise RuntimeError(f"replica {self.name}: {why}")

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.name, self.app.state.metrics.render().decode())
            except Exception as e:  # noqa: BLE001 (the board restarting must not end the pushes)
                log.warning("metrics push failed: %s", e)
            await asyncio.sleep(PUSH_PERIOD_S)

    async def __del__(self) -> None:
        self.scheduler.draining = True
        if self._pusher is not None:
            self._pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pusher
        await self._lifespan.__aexit__(None, None, None)
