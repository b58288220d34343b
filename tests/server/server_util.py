"""Start `specdec serve` on a tiny model in a subprocess on a free loopback port; raw HTTP helpers."""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`python -m specdec.cli serve ...` on 127.0.0.1; ``stop()`` always ends it."""

    def __init__(self, model_dir: Path, *args: str, api_key: str | None = None, timeout: float = 120.0,
                 module: str = "specdec.cli", env: dict[str, str] | None = None, log: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model = str(model_dir)
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", module, "serve", "--model", self.model, "--dtype", "float32",
               "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | (env or {})
        # log: the output goes to this file (a chatty server, e.g. on Ray, must not fill a pipe nobody reads)
        self.log = log
        out = open(log, "wb") if log is not None else subprocess.PIPE  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        if log is not None:
            out.close()  # the child holds its own
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def output(self) -> str:
        """What the server printed (all of it once it has exited; with ``log``: so far)."""
        if self.log is not None:
            return self.log.read_text(errors="replace")
        return self.proc.stdout.read().decode()

    def request(self, method: str, path: str, body: dict | bytes | None = None, key: str | None = "default",
                timeout: float = 60.0) -> tuple[int, dict | str]:
        """One request; returns (status, parsed JSON or text)."""
        key = self.api_key if key == "default" else key
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read().decode()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample of /metrics (0 if absent), e.g. metric("specdec:num_requests_running")."""
        _, text = self.request("GET", "/metrics")
        pattern = re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)$"
        m = re.search(pattern, text, re.M)
        return float(m.group(1)) if m else 0.0

    def wait_metric(self, name: str, value: float, timeout: float = 5.0, labels: str = "") -> float:
        deadline = time.monotonic() + timeout
        while True:
            v = self.metric(name, labels)
            if v == value or time.monotonic() > deadline:
                return v
            time.sleep(0.05)


KEY = "test-key"  # the API key the server tests start their servers with


def spec(enabled: bool, **kw) -> dict:
    """``extra_body`` of a request with speculation on or off (and EOS ignored: fixed lengths)."""
    return {"speculative": {"enabled": enabled}, "ignore_eos": True} | kw


def templated_model(root: Path, chat_template: str, context: int) -> Path:
    """A tiny random model whose tokenizer has ``chat_template`` (a tools template) and whose context
    is ``context`` tokens."""
    from transformers import PreTrainedTokenizerFast

    from conftest import make_model_dir

    model = make_model_dir(root / "model")
    tok = PreTrainedTokenizerFast.from_pretrained(str(model))
    tok.chat_template = chat_template
    tok.save_pretrained(str(model))
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": context}))
    return model


def chat_choice(client, **args) -> tuple[str | None, list[dict], str]:
    """(content, tool calls as dicts, finish reason) of one chat choice through the openai client;
    with ``stream=True`` the deltas are joined as OpenAI's clients do (tool calls by index)."""
    if not args.pop("stream", False):
        c = client.chat.completions.create(**args).choices[0]
        return c.message.content, [t.model_dump() for t in c.message.tool_calls or []], c.finish_reason
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(stream=True, **args):
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            cur = calls.setdefault(t.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            cur["id"] = t.id or cur["id"]
            cur["function"]["name"] += t.function.name or ""
            cur["function"]["arguments"] += t.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish
