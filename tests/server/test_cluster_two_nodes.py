"""A real two-node Ray cluster on one machine: head and worker in two network namespaces made here,
joined by a veth pair on a private /24; `specdec serve --ray-address` on the head node places one engine
replica per node (one CPU each) and a client inside the head namespace gets answers. Needs root (ip
netns); everything started here is ended by process id, inside the namespaces only (never `ray stop`,
which would end every Ray process on the machine)."""
from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import make_model_dir
from server_util import ROOT

pytest.importorskip("ray")
pytest.importorskip("openai")
pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
RAY_PORT, HTTP_PORT = 6380, 8011  # inside the namespaces: nothing else listens there
NODE_FLAGS = ("--num-cpus", "1", "--object-store-memory", str(100 * 2**20), "--disable-usage-stats", "--block")
CLIENT = """
import json, sys, openai
url, model = sys.argv[1:3]
c = openai.OpenAI(base_url=url, api_key="none", max_retries=3, timeout=60)
out = [c.completions.create(model=model, prompt=f"{i} node", max_tokens=4).choices[0].text for i in range(4)]
chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                        stream=True))
print(json.dumps({"texts": out, "finish": chunks[-1].choices[0].finish_reason}))
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _free_subnet() -> str:
    """``10.231.N`` for an N no route or address of this machine uses."""
    used = _ip("-4", "route").stdout + _ip("-4", "addr").stdout
    free = [n for n in range(1, 255) if f"10.231.{n}." not in used]
    return f"10.231.{random.choice(free)}"


def _pids(ns: str) -> list[int]:
    """The processes in network namespace ``ns`` (all started by this test)."""
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def _titles(ns: str) -> list[str]:
    titles = []
    for pid in _pids(ns):
        try:
            titles.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return titles


def _end(ns: str, grace: float) -> None:
    """SIGTERM every process in ``ns``, then SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in _pids(ns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _pids(ns) and time.monotonic() < deadline:
            time.sleep(0.2)


def test_one_replica_on_each_of_two_nodes(tmp_path):
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    head, worker = f"sdh{tag}", f"sdw{tag}"
    probe = _ip("netns", "add", head, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create network namespaces (root and ip netns needed): {probe.stderr.strip()}")
    net = _free_subnet()
    head_ip, worker_ip = f"{net}.1", f"{net}.2"
    temp = Path(tempfile.mkdtemp(prefix="sdr", dir="/tmp"))  # Ray's sockets: a short path
    procs: list[subprocess.Popen] = []
    token = temp / "auth_token"  # the cluster's own token (Ray's token authentication), for its nodes only
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
                        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}

    def start(ns: str, *cmd: str, log: str) -> subprocess.Popen:
        out = open(tmp_path / log, "wb")  # noqa: SIM115 (the child holds it)
        p = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        procs.append(p)
        return p

    def wait_for(what: str, cond, timeout: float, proc: subprocess.Popen, log: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            tail = (tmp_path / log).read_text(errors="replace")[-3000:]
            assert proc.poll() is None, f"{what}: exited {proc.returncode}: {tail}"
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s: {tail}"
            time.sleep(0.3)

    try:
        _ip("netns", "add", worker)
        _ip("link", "add", f"ve{head}", "type", "veth", "peer", "name", f"ve{worker}")
        for ns, ip in ((head, head_ip), (worker, worker_ip)):
            _ip("link", "set", f"ve{ns}", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", f"ve{ns}")
            _ip("-n", ns, "link", "set", f"ve{ns}", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        model = make_model_dir(tmp_path / "model")
        t0 = time.monotonic()
        start(head, RAY, "start", "--head", "--node-ip-address", head_ip, "--port", str(RAY_PORT),
              "--include-dashboard", "false", "--temp-dir", str(temp / "h"), *NODE_FLAGS, log="head.log")
        h = procs[-1]
        wait_for("ray head", lambda: "Ray runtime started" in (tmp_path / "head.log").read_text(), 60, h, "head.log")
        start(worker, RAY, "start", "--address", f"{head_ip}:{RAY_PORT}", "--node-ip-address", worker_ip,
              "--temp-dir", str(temp / "w"), *NODE_FLAGS, log="worker.log")
        w = procs[-1]
        wait_for("ray worker", lambda: "Ray runtime started" in (tmp_path / "worker.log").read_text(), 60, w,
                 "worker.log")
        srv = start(head, sys.executable, "-m", "specdec.cli", "serve", "--model", str(model), "--dtype", "float32",
                    "--ray-address", f"{head_ip}:{RAY_PORT}", "--host", head_ip, "--port", str(HTTP_PORT),
                    "--replicas", "2", "--max-batch-size", "2", "--max-model-len", "128", "--drain-timeout", "1",
                    "--log-level", "warning", log="serve.log")
        wait_for("specdec serve", lambda: "serving on" in (tmp_path / "serve.log").read_text(), 150, srv, "serve.log")
        up = time.monotonic() - t0

        engines = {ns: [t for t in _titles(ns) if t.startswith("ray::ServeReplica:specdec:SpecdecEngine")]
                   for ns in (head, worker)}
        assert [len(engines[head]), len(engines[worker])] == [1, 1], engines
        got = subprocess.run(["ip", "netns", "exec", head, sys.executable, "-c", CLIENT,
                              f"http://{head_ip}:{HTTP_PORT}/v1", str(model)],
                             env=env, capture_output=True, text=True, timeout=120)
        assert got.returncode == 0, got.stderr[-3000:]
        answer = json.loads(got.stdout.strip().splitlines()[-1])
        assert len(answer["texts"]) == 4 and all(answer["texts"]) and answer["finish"] == "length"
        print(f"two-node cluster serving {up:.1f} s after `ray start --head`")
        srv.send_signal(signal.SIGTERM)  # deletes the app: the replicas drain
        srv.wait(30)
        assert srv.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        for ns in (head, worker):
            _end(ns, grace=10.0)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()  # `ip netns exec` itself, in the host namespace: ours
        for ns in (head, worker):
            _ip("netns", "del", ns, check=False)  # its veth end goes with it, and the peer with that
        _ip("link", "del", f"ve{head}", check=False)  # if it was never moved
        shutil.rmtree(temp, ignore_errors=True)
