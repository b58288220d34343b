"""OpenAI-compatible HTTP server: `specdec serve` (app.py, scheduler.py, protocol.py, metrics.py).

This module only holds the command line part; the server itself is imported when it runs, so
`specdec --help` stays fast.
"""
from __future__ import annotations

import argparse

from specdec.args import add_model_args, add_spec_args, deployment_config, speculative_config

DEFAULT_SPEC_MAX_BATCH = 10  # speculate up to this batch size: see scheduler.py for the measurement
DEFAULT_MAX_PREFILL_TOKENS = 512  # chunked prefill: prompt tokens per engine step


def add_serve_parser(sub) -> None:
    """Register `specdec serve` on the CLI's subparsers."""
    s = sub.add_parser("serve", help="serve an OpenAI-compatible API with continuous batching")
    add_model_args(s, config=True)
    add_spec_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model, else the --config's model)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    s.add_argument("--max-batch-size", type=int, default=16, help="KV cache rows: sequences run at once (default 16)")
    s.add_argument("--spec-max-batch", type=int, default=None,
                   help="speculate only while at most this many sequences run (default: the --config's, else "
                        f"{DEFAULT_SPEC_MAX_BATCH}, the break-even measured on a 2-core CPU)")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="sequences allowed to wait for a batch row; past it requests get 429 with Retry-After "
                        "(default 256; 0: no limit)")
    s.add_argument("--max-prompts", type=int, default=64, help="prompts per completion request (default 64)")
    s.add_argument("--max-request-tokens", type=int, default=None,
                   help="prompt + max_tokens tokens over a request's choices (default: no limit)")
    s.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take, waiting included; then 408 or an error event (default: none)")
    s.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="chunked prefill: prompt tokens prefilled per engine step, between decode steps, so a "
                        "long prompt does not stall running streams; below 512 it is also the size of every "
                        "prefill call, and at 32 or less (bf16) a chunk rides inside the decode step's forward: "
                        "24 keeps running streams within 2x their pace, at the cost of the long prompt's own "
                        f"prefill speed (default: the --config's, else {DEFAULT_MAX_PREFILL_TOKENS}; 0: whole "
                        "prompts)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds in-flight requests may take to finish before they are cancelled "
                        "(default 30); new requests get 503 meanwhile; the exit status is 0")
    s.add_argument("--health-stale-after", type=float, default=60.0,
                   help="/health answers 503 when the engine thread has not made progress for this many seconds "
                        "(default 60)")
    s.add_argument("--record-traffic", default=None, metavar="DIR",
                   help="record each finished request's prompt and the target's output (token ids and text) as "
                        "JSON lines in DIR, for distilling a drafter on real traffic; opt-in (default: off)")
    s.add_argument("--record-traffic-mb", type=int, default=1024,
                   help="the recording's size cap in MB: files rotate at 64 MB, the oldest go past the cap "
                        "(default 1024)")
    s.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    from specdec.server.cluster import add_cluster_args  # noqa: PLC0415
    add_cluster_args(s)
    s.set_defaults(func=cmd_serve)


def engine_limits(a: argparse.Namespace, deployment) -> tuple[int, int]:
    """--spec-max-batch and --max-prefill-tokens as given, else the deployment config's, else the
    defaults (max_prefill_tokens 0: whole prompts)."""
    spec_max_batch = next(v for v in (a.spec_max_batch, deployment.spec_max_batch, DEFAULT_SPEC_MAX_BATCH)
                          if v is not None)
    max_prefill_tokens = next(v for v in (a.max_prefill_tokens, deployment.max_prefill_tokens,
                                          DEFAULT_MAX_PREFILL_TOKENS) if v is not None)
    return spec_max_batch, max_prefill_tokens


def check_serve_args(a: argparse.Namespace) -> None:
    """SpecdecError for a flag out of range, before anything is loaded (or a cluster started)."""
    from specdec.errors import SpecdecError  # noqa: PLC0415

    if a.max_batch_size < 1 or (a.spec_max_batch is not None and a.spec_max_batch < 0):
        raise SpecdecError("--max-batch-size must be >= 1 and --spec-max-batch >= 0")
    for flag, value, low in (("--max-waiting", a.max_waiting, 0), ("--max-prompts", a.max_prompts, 1),
                             ("--max-request-tokens", a.max_request_tokens, 1),
                             ("--max-prefill-tokens", a.max_prefill_tokens, 0), ("--drain-timeout", a.drain_timeout, 0),
                             ("--request-timeout", a.request_timeout, 1e-3),
                             ("--health-stale-after", a.health_stale_after, 1e-3)):
        if value is not None and value < low:
            raise SpecdecError(f"{flag} must be >= {low}, got {value}")
    if not 0 < a.port < 65536:
        raise SpecdecError(f"--port must be in 1..65535, got {a.port}")
    if a.record_traffic_mb < 1:
        raise SpecdecError(f"--record-traffic-mb must be >= 1, got {a.record_traffic_mb}")
    if a.record_traffic:  # fail before loading the model
        from specdec.server.traffic import TrafficRecorder  # noqa: PLC0415
        TrafficRecorder(a.record_traffic).close()
    deployment_config(a)  # names the model, or fails


def build_app(a: argparse.Namespace):
    """Load the model the (checked) flags name and return ``(app, llm, config)``: the FastAPI app of
    one server, whose engine thread runs while the app's lifespan runs. A Ray Serve engine replica
    (``cluster/``) builds the same app from the same flags."""
    from specdec.llm import LLM  # noqa: PLC0415
    from specdec.server.app import ServerConfig, create_app  # noqa: PLC0415

    deployment = deployment_config(a)
    spec_max_batch, max_prefill_tokens = engine_limits(a, deployment)
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
              max_num_seqs=a.max_batch_size, config=deployment, speculative_config=speculative_config(a),
              quantization=a.quantization, kv_cache_memory=a.kv_cache_memory)
    llm.spec_max_batch, llm.max_prefill_tokens = spec_max_batch, max_prefill_tokens or None
    if max_prefill_tokens and max_prefill_tokens < llm.runner.prefill_chunk:
        # every prompt is prefilled in these pieces (chunked or not: the cache is written by the same calls)
        llm.runner.prefill_chunk = max_prefill_tokens
    config = ServerConfig(model_name=a.served_model_name or a.model or deployment.model, api_key=a.api_key,
                          max_batch_size=a.max_batch_size, spec_max_batch=spec_max_batch,
                          max_waiting=a.max_waiting or None, max_prompts=a.max_prompts,
                          max_request_tokens=a.max_request_tokens, request_timeout=a.request_timeout,
                          max_prefill_tokens=max_prefill_tokens or None, stale_after=a.health_stale_after,
                          record_traffic=a.record_traffic, record_traffic_bytes=a.record_traffic_mb << 20)
    return create_app(llm, config), llm, config


def cmd_serve(a: argparse.Namespace) -> int:
    from specdec.server.cluster import cluster_requested  # noqa: PLC0415

    check_serve_args(a)
    if cluster_requested(a):
        from specdec.server.cluster import serve_cluster  # noqa: PLC0415
        return serve_cluster(a)
    from specdec.server.app import serve  # noqa: PLC0415

    from specdec.server.playground import speculation_label  # noqa: PLC0415

    app, llm, config = build_app(a)
    spec = speculation_label(llm.speculative_method, llm.num_speculative_tokens, llm.adaptive)
    print(f"serving '{config.model_name}' on http://{a.host}:{a.port}/v1 (context {llm.max_model_len}, "
          f"batch {a.max_batch_size}, speculation: {spec}); playground: http://{a.host}:{a.port}/", flush=True)
    serve(app, a.host, a.port, a.log_level, a.drain_timeout)
    return 0
