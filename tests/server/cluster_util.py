"""`specdec serve --replicas N` in a subprocess (its private Ray instance on 127.0.0.1), and its replicas."""
from __future__ import annotations

import argparse
import os
import re
import signal
from pathlib import Path

from server_util import ServerProcess

CLUSTER_FLAGS = ("--max-batch-size", "4", "--max-model-len", "256", "--drain-timeout", "1", "--log-level", "warning")


def cluster_server(model: Path | str, tmp: Path, *args: str, replicas: int = 2) -> ServerProcess:
    """A Ray Serve app of ``replicas`` engine replicas, small caches, short drains; its output in ``tmp``."""
    return ServerProcess(model, "--replicas", str(replicas), *CLUSTER_FLAGS, *args, timeout=240,
                         log=tmp / "serve.log")


def engine_replica_pids(server: ServerProcess) -> list[int]:
    """The processes of this server's engine replicas (descendants of it only: other Ray users untouched)."""
    children: dict[int, list[int]] = {}
    titles: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            titles[int(d)] = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    mine, todo = [], [server.proc.pid]
    while todo:
        pid = todo.pop()
        mine.append(pid)
        todo += children.get(pid, [])
    return [p for p in mine if re.match(r"ray::ServeReplica:specdec:SpecdecEngine", titles.get(p, ""))]


def kill_replica(server: ServerProcess) -> int:
    pid = engine_replica_pids(server)[0]
    os.kill(pid, signal.SIGKILL)
    return pid


def serve_args(model: Path | str, *args: str) -> argparse.Namespace:
    """``specdec serve``'s parsed flags for ``model`` with the small cluster settings, for tests that build
    the application or a replica themselves."""
    from specdec.server import add_serve_parser, check_serve_args

    parser = argparse.ArgumentParser(prog="specdec")
    add_serve_parser(parser.add_subparsers())
    a = parser.parse_args(["serve", "--model", str(model), "--dtype", "float32", *CLUSTER_FLAGS, *args])
    check_serve_args(a)
    return a
