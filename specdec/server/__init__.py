"""OpenAI-compatible HTTP server: `specdec serve` (app.py, scheduler.py, protocol.py, metrics.py).

This module only holds the command (its flags live in ``flags.py``, shared with the Ray Serve
cluster); the server itself is imported when it runs, so `specdec --help` stays fast.
"""
from __future__ import annotations

import argparse

from specdec.server.flags import (DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_REQUEST_TIMEOUT, DEFAULT_SPEC_MAX_BATCH,
                                  add_serve_flags, check_serve_args, cluster_requested, engine_limits)

__all__ = ["DEFAULT_MAX_PREFILL_TOKENS", "DEFAULT_REQUEST_TIMEOUT", "DEFAULT_SPEC_MAX_BATCH", "add_serve_parser",
           "check_serve_args", "cmd_serve", "engine_limits"]


def add_serve_parser(sub) -> None:
    """Register `specdec serve` on the CLI's subparsers."""
    s = sub.add_parser("serve", help="serve an OpenAI-compatible API with continuous batching")
    add_serve_flags(s)
    s.set_defaults(func=cmd_serve)


def cmd_serve(a: argparse.Namespace) -> int:
    check_serve_args(a)
    if cluster_requested(a):
        from specdec.server.cluster import serve_cluster  # noqa: PLC0415 (Ray: only when asked for)
        return serve_cluster(a)
    from specdec.server.app import build_app, serve  # noqa: PLC0415 (torch)

    from specdec.server.playground import speculation_label  # noqa: PLC0415

    app, llm, config = build_app(a)
    spec = speculation_label(llm.speculative_method, llm.num_speculative_tokens, llm.adaptive)
    print(f"serving '{config.model_name}' on http://{a.host}:{a.port}/v1 (context {llm.max_model_len}, "
          f"batch {a.max_batch_size}, speculation: {spec}); playground: http://{a.host}:{a.port}/", flush=True)
    serve(app, a.host, a.port, a.log_level, a.drain_timeout)
    return 0
