"""Scale out on Ray Serve: N engine replicas behind one OpenAI endpoint (``pip install specdec[cluster]``).

    specdec serve --model smollm2-135m --replicas 2                 # a local Ray instance, 2 replicas
    specdec serve --model smollm2-135m --min-replicas 1 --max-replicas 4   # autoscaling
    serve run specdec.server.cluster:app_builder model=smollm2-135m replicas=2   # one's own cluster

Layout: ``app.py`` the Serve application (three deployments: the ingress, the engine replicas, the
metrics board); ``ingress.py`` forwarding, retries and the merged /metrics; ``replica.py`` the engine
replica (the single server's app, in process); ``relay.py`` one request through an ASGI app;
``routing.py`` / ``router.py`` prefix affinity; ``metrics.py`` the merge. This module holds only
what ``specdec serve`` needs without Ray: the clear error when Ray is missing (the flags are
``specdec/server/flags.py``'s, shared with the single server).
"""
from __future__ import annotations

import argparse

from specdec.errors import SpecdecError
from specdec.server.flags import add_serve_flags, check_cluster_args, check_serve_args


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
    from specdec.server.cluster.app import application  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="specdec serve", exit_on_error=False)
    add_serve_flags(parser)
    argv = []
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
