"""The flags of `specdec serve` and their defaults, for the single server and the Ray Serve cluster.

Both the server (``specdec.server``: the command; ``app.py``: the app built from the flags) and the
cluster (``specdec.server.cluster``: ``app_builder`` parses the same flags) read them from here, so
neither package imports the other's ``__init__`` (tests/test_imports.py keeps the import graph
acyclic). Nothing here imports torch or Ray: `specdec --help` stays fast.
"""
from __future__ import annotations

import argparse

from specdec.args import add_model_args, add_spec_args, deployment_config
from specdec.errors import SpecdecError

DEFAULT_SPEC_MAX_BATCH = 10  # speculate up to this batch size: see scheduler.py for the measurement
DEFAULT_MAX_PREFILL_TOKENS = 512  # chunked prefill: prompt tokens per engine step
DEFAULT_PREFILL_SLOWDOWN = 1.5  # beside decoding streams: a step with prompt tokens takes at most 1.5x one without
# seconds a request may take, waiting included: a finite default, so that no client waits forever on an
# engine that stopped answering (a 32k-token answer at 20 tokens/s needs more: raise it, or 0 for none)
DEFAULT_REQUEST_TIMEOUT = 600.0
# bytes of a request body: a 128k-token prompt as text or token ids is about 1 MB of JSON
DEFAULT_MAX_BODY_MB = 8


def add_serve_flags(s: argparse.ArgumentParser) -> None:
    """Every flag of `specdec serve` (the cluster's included) on ``s``."""
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
                   help="sequences (each choice of each prompt) allowed to wait for a batch row, a new request's "
                        "own counted; past it requests get 429 with Retry-After, and a request of more sequences "
                        "than this alone 400 (default 256; 0: no limit)")
    s.add_argument("--max-prompts", type=int, default=64, help="prompts per completion request (default 64)")
    s.add_argument("--max-request-tokens", type=int, default=None,
                   help="prompt + max_tokens tokens over a request's choices; past it 400 (default: the "
                        "context length x 16 (the most choices a request may ask for) or x --max-batch-size if "
                        "larger: no request of one prompt is refused for it; 0: no limit)")
    s.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_MB,
                   help="megabytes of a request body; past it 413, answered before the body is read (default "
                        f"{DEFAULT_MAX_BODY_MB}; 0: no limit)")
    s.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT,
                   help="seconds a request may take, waiting included; then 408 or an error event (default "
                        f"{DEFAULT_REQUEST_TIMEOUT:.0f}; 0: no limit)")
    s.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="chunked prefill: prompt tokens prefilled per engine step, between decode steps, so a "
                        "long prompt does not stall running streams; below 512 it is also the size of every "
                        "prefill call, and at 32 or less (bf16) a chunk rides inside the decode step's forward: "
                        "24 keeps running streams within 2x their pace, at the cost of the long prompt's own "
                        f"prefill speed (default: the --config's, else {DEFAULT_MAX_PREFILL_TOKENS}; 0: whole "
                        "prompts)")
    s.add_argument("--prefill-slowdown", type=float, default=DEFAULT_PREFILL_SLOWDOWN,
                   help="while other requests decode, a prompt is prefilled a few tokens per step, as many as keep "
                        "a step within this many times a step without them (measured as it runs; at least one "
                        f"chunk a step): running streams keep 1/x of their pace (default {DEFAULT_PREFILL_SLOWDOWN}; "
                        "0: --max-prefill-tokens per step whatever it costs them)")
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
    add_cluster_args(s)


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
    if a.max_batch_size < 1 or (a.spec_max_batch is not None and a.spec_max_batch < 0):
        raise SpecdecError("--max-batch-size must be >= 1 and --spec-max-batch >= 0")
    for flag, value, low in (("--max-waiting", a.max_waiting, 0), ("--max-prompts", a.max_prompts, 1),
                             ("--max-request-tokens", a.max_request_tokens, 0), ("--max-body-mb", a.max_body_mb, 0),
                             ("--max-prefill-tokens", a.max_prefill_tokens, 0), ("--drain-timeout", a.drain_timeout, 0),
                             ("--request-timeout", a.request_timeout, 0),
                             ("--health-stale-after", a.health_stale_after, 1e-3)):
        if value is not None and not value >= low:  # NaN too
            raise SpecdecError(f"{flag} must be >= {low}, got {value}")
    if not (a.prefill_slowdown == 0 or a.prefill_slowdown > 1.0):  # NaN included
        raise SpecdecError(f"--prefill-slowdown must be > 1 (or 0: off), got {a.prefill_slowdown}")
    if not 0 < a.port < 65536:
        raise SpecdecError(f"--port must be in 1..65535, got {a.port}")
    if a.record_traffic_mb < 1:
        raise SpecdecError(f"--record-traffic-mb must be >= 1, got {a.record_traffic_mb}")
    if a.record_traffic:  # fail before loading the model
        from specdec.server.traffic import TrafficRecorder  # noqa: PLC0415
        TrafficRecorder(a.record_traffic).close()
    deployment_config(a)  # names the model, or fails


# ---- scaling out on Ray Serve (specdec.server.cluster) ---------------------------------------------
def add_cluster_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("scaling out on Ray Serve (pip install specdec[cluster]; docs/scaling-out.md)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve with this many engine replicas behind Ray Serve's proxy (default: none, this "
                        "process serves alone); with --min/--max-replicas: the count to start with")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale on ongoing requests between --min-replicas and --max-replicas (default: none, a "
                        "fixed --replicas)")
    g.add_argument("--max-replicas", type=int, default=None, help="see --min-replicas (default: none)")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling aims at this many ongoing requests per replica (default: --max-batch-size)")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves for each engine replica (default 1; a GPU replica: use a Serve "
                        "config file's ray_actor_options)")
    g.add_argument("--retries", type=int, default=3,
                   help="times the ingress resends a request whose replica died before answering (default 3)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto': the one running here) instead of starting a private "
                        "Ray instance on 127.0.0.1 that ends with the server (default)")


def cluster_requested(a: argparse.Namespace) -> bool:
    return any(v is not None for v in (a.replicas, a.min_replicas, a.max_replicas, a.ray_address))


def check_cluster_args(a: argparse.Namespace) -> None:
    """SpecdecError for cluster flags that do not fit together."""
    for flag, value, low in (("--replicas", a.replicas, 1), ("--min-replicas", a.min_replicas, 1),
                             ("--max-replicas", a.max_replicas, 1), ("--retries", a.retries, 0),
                             ("--target-ongoing-requests", a.target_ongoing_requests, 1e-3),
                             ("--replica-cpus", a.replica_cpus, 1e-3)):
        if value is not None and not value >= low:  # NaN too
            raise SpecdecError(f"{flag} must be >= {low}, got {value}")
    if (a.min_replicas is None) != (a.max_replicas is None):
        raise SpecdecError("give both --min-replicas and --max-replicas (autoscaling), or neither")
    if a.min_replicas is not None:
        if a.min_replicas > a.max_replicas:
            raise SpecdecError(f"--min-replicas ({a.min_replicas}) is above --max-replicas ({a.max_replicas})")
        if a.replicas is not None and not a.min_replicas <= a.replicas <= a.max_replicas:
            raise SpecdecError(f"--replicas ({a.replicas}) must lie within --min-replicas and --max-replicas")
