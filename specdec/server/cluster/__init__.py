"""Scale out on Ray Serve: N engine replicas behind one OpenAI endpoint (``pip install specdec[cluster]``).

    specdec serve --model smollm2-135m --replicas 2                 # a local Ray instance, 2 replicas
    specdec serve --model smollm2-135m --min-replicas 1 --max-replicas 4   # autoscaling
    serve run specdec.server.cluster:app_builder model=smollm2-135m replicas=2   # one's own cluster

Layout: ``app.py`` the Serve application (three deployments: the ingress, the engine replicas, the
metrics board); ``ingress.py`` forwarding, retries and the merged /metrics; ``replica.py`` the engine
replica (the single server's app, in process); ``relay.py`` one request through an ASGI app;
``routing.py`` / ``router.py`` prefix affinity; ``metrics.py`` the merge. This module holds only
what ``specdec serve`` needs without Ray: the flags, and the clear error when Ray is missing.
"""
from __future__ import annotations

import argparse

from specdec.errors import SpecdecError

APP_NAME = "specdec"


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
        if value is not None and value < low:
            raise SpecdecError(f"{flag} must be >= {low}, got {value}")
    if (a.min_replicas is None) != (a.max_replicas is None):
        raise SpecdecError("give both --min-replicas and --max-replicas (autoscaling), or neither")
    if a.min_replicas is not None:
        if a.min_replicas > a.max_replicas:
            raise SpecdecError(f"--min-replicas ({a.min_replicas}) is above --max-replicas ({a.max_replicas})")
        if a.replicas is not None and not a.min_replicas <= a.replicas <= a.max_replicas:
            raise SpecdecError(f"--replicas ({a.replicas}) must lie within --min-replicas and --max-replicas")


def require_ray():
    """``(ray, ray.serve)``, or a SpecdecError saying how to install them."""
    try:
        import ray  # noqa: PLC0415
        from ray import serve  # noqa: PLC0415
    except ImportError as e:
        raise SpecdecError(f"serving on Ray Serve (--replicas, --min/--max-replicas, --ray-address) needs Ray "
                           f"Serve, which is not installed ({e}): pip install 'specdec[cluster]'") from None
    return ray, serve


def serve_cluster(a: argparse.Namespace) -> int:
    """``specdec serve`` with replicas: run the application until SIGTERM / SIGINT, then drain."""
    check_cluster_args(a)
    require_ray()
    from specdec.server.cluster.launch import run  # noqa: PLC0415
    return run(a)


def app_builder(args: dict):
    """The Ray Serve application builder (``serve run specdec.server.cluster:app_builder key=value ...``
    or ``import_path`` in a Serve config file): ``args`` are ``specdec serve``'s flags without their
    dashes (``max_batch_size: 8``, ``replicas: 2``; true for a switch)."""
    require_ray()
    from specdec.server import add_serve_parser, check_serve_args  # noqa: PLC0415
    from specdec.server.cluster.app import application  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="specdec", exit_on_error=False)
    add_serve_parser(parser.add_subparsers())
    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or (isinstance(value, str) and value.lower() == "true"):
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    try:
        a = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise SpecdecError(f"specdec app args {args}: {e}") from None
    check_serve_args(a)
    check_cluster_args(a)
    return application(a)
