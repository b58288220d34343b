"""``specdec serve --replicas N``: start (or join) Ray, run the application, drain on SIGTERM / SIGINT."""
from __future__ import annotations

import argparse
import math
import os
import signal
import threading

import ray
from ray import serve

from specdec.server.cluster.app import APP_NAME, application


def run(a: argparse.Namespace) -> int:
    """Serve until a signal; then delete the application (replicas drain for up to --drain-timeout
    seconds) and, for a private Ray instance, stop it. Exit status 0."""
    own = a.ray_address is None
    if own:  # a private instance on loopback, sized so every replica can be placed (CPUs may be shared)
        most = a.max_replicas or a.replicas or 1
        ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(most * a.replica_cpus)), include_dashboard=False,
                 _node_ip_address="127.0.0.1", configure_logging=False)
    else:
        ray.init(address=a.ray_address, configure_logging=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": a.host, "port": a.port})
        serve.run(application(a), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"serving on http://{a.host}:{a.port}/v1 with Ray Serve ({_scale(a)}, batch {a.max_batch_size} each, "
              f"speculation: {_speculation(a)}; Ray at {ray.get_runtime_context().gcs_address}); playground: "
              f"http://{a.host}:{a.port}/", flush=True)
        while not stop.wait(0.5):
            pass
        serve.delete(APP_NAME)  # stops routing, drains each replica, then calls its __del__
    finally:
        if own:
            serve.shutdown()
            ray.shutdown()
    return 0


def _scale(a: argparse.Namespace) -> str:
    if a.min_replicas is not None:
        return f"{a.min_replicas}..{a.max_replicas} replicas, autoscaling"
    return f"{a.replicas or 1} replica{'s' if (a.replicas or 1) > 1 else ''}"


def _speculation(a: argparse.Namespace) -> str:
    """The method and K the replicas run (the flags', else the --config's), as the single server says it."""
    from specdec.args import deployment_config, speculative_config  # noqa: PLC0415
    from specdec.proposers.registry import parse_config  # noqa: PLC0415
    from specdec.server.playground import speculation_label  # noqa: PLC0415

    cfg = speculative_config(a) or deployment_config(a).speculative_config
    opts = parse_config(cfg) if cfg else None
    return speculation_label(opts and opts.method, opts.num_speculative_tokens if opts else 0,
                             bool(opts and opts.adaptive))
