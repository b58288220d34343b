"""The Ray Serve application: ingress -> engine replicas (prefix-affinity router), metrics board.

Options the flags set (a Serve config file's ``deployments:`` section may override any of them):

- ``SpecdecEngine``: ``--replicas`` replicas, or autoscaling between ``--min-replicas`` and
  ``--max-replicas`` aiming at ``--target-ongoing-requests`` per replica (default: one full batch,
  ``--max-batch-size``); ``max_ongoing_requests`` two batches (what waits beyond waits in the
  router, where a replica that frees up or a new one takes it); drain ``--drain-timeout`` seconds;
  health checked every ``HEALTH_PERIOD_S`` seconds; ``--replica-cpus`` CPUs each.
- ``SpecdecIngress``: one replica, no CPU reserved, many requests at once (it only forwards).
- ``SpecdecMetrics``: one replica holding each engine replica's latest metrics.
"""
from __future__ import annotations

import argparse

from ray import serve
from ray.serve.config import RequestRouterConfig

from specdec.server.cluster.ingress import Ingress
from specdec.server.cluster.metrics import MetricsBoard
from specdec.server.cluster.replica import Engine
from specdec.server.cluster.router import PrefixAffinityRouter

APP_NAME = "specdec"  # the Serve application's name
HEALTH_PERIOD_S = 5.0
HEALTH_TIMEOUT_S = 30.0
INGRESS_MAX_ONGOING = 4096


def engine_options(a: argparse.Namespace) -> dict:
    """The engine deployment's options from ``specdec serve``'s flags."""
    opts = dict(name="SpecdecEngine", max_ongoing_requests=2 * a.max_batch_size,
                graceful_shutdown_timeout_s=a.drain_timeout, graceful_shutdown_wait_loop_s=min(1.0, a.drain_timeout or 1.0),
                health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=HEALTH_TIMEOUT_S,
                ray_actor_options={"num_cpus": a.replica_cpus},
                request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter))
    if a.min_replicas is not None:
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
            "initial_replicas": a.replicas if a.replicas is not None else a.min_replicas,
            "target_ongoing_requests": a.target_ongoing_requests or a.max_batch_size}
    else:
        opts["num_replicas"] = a.replicas or 1
    return opts


def application(a: argparse.Namespace):
    """The bound application for ``serve.run`` (checked flags: ``check_serve_args``, ``check_cluster_args``)."""
    logs = {"log_level": a.log_level.upper(), "enable_access_log": False}  # no line per metrics push
    board = serve.deployment(MetricsBoard, name="SpecdecMetrics", num_replicas=1, max_ongoing_requests=1024,
                             ray_actor_options={"num_cpus": 0}, logging_config=logs).bind()
    engine = serve.deployment(Engine).options(**engine_options(a), logging_config=logs).bind(a, board)
    ingress = serve.deployment(Ingress, name="SpecdecIngress", num_replicas=1, logging_config=logs,
                               max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0})
    # 0: no limit; the body limit is the replicas' too, checked here before the body crosses to one
    return ingress.bind(engine, board, a.retries, a.request_timeout or None, int(a.max_body_mb * 2**20) or None)
