"""The web playground at ``/``: static files shipped in the package (``static/``), no build step.

The page (``static/index.html``, ``playground.js``, ``playground.css``: plain HTML, CSS and
JavaScript, nothing to install) talks to the server's own OpenAI endpoints: it streams
``/v1/chat/completions`` with ``"specdec": {"provenance": true}`` (``provenance.py``) and colours
each token by where it came from. It reads the method, K and the per-request options from the
``speculative`` field this server adds to its ``/v1/models`` card (``speculation_card``).

Both servers serve it: ``specdec serve`` (``app.py``) and the Ray Serve ingress
(``cluster/ingress.py``, without a round trip to an engine replica). Only the files named in
``FILES`` are served, so no request path reaches the file system.
"""
from __future__ import annotations

import typing
from functools import cache
from pathlib import Path

from starlette.responses import Response

from specdec.proposers.options import SpecOptions

STATIC = Path(__file__).with_name("static")
# URL path -> (file in static/, media type)
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/static/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
         "/static/playground.css": ("playground.css", "text/css; charset=utf-8"),
         "/static/favicon.svg": ("favicon.svg", "image/svg+xml")}


@cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def page(path: str) -> Response | None:
    """The playground's file at URL ``path`` (None: not one of its files)."""
    found = FILES.get(path)
    if found is None:
        return None
    name, media = found
    return Response(_read(name), media_type=media, headers={"Cache-Control": "no-cache"})


def speculation_label(method: str | None, k: int, adaptive: bool = False) -> str:
    """How the start-up banner names the speculation in use: ``ngram, K=4`` or ``off``."""
    if not method or not k:
        return "off"
    return f"{method}, K={k}" + (" (adaptive)" if adaptive else "")


def speculation_card(opts: SpecOptions | None, k: int) -> dict:
    """The ``speculative`` field of the ``/v1/models`` card: the method, its K (``k``: the engine's,
    0 when off) and the options a request may set in its ``speculative`` object, each with its type,
    bounds, default (the server's value) and help, so a client builds its controls from it."""
    if opts is None or not k:
        return {"method": None, "num_speculative_tokens": 0, "per_request": {}}
    hints = typing.get_type_hints(type(opts))
    fields = {f.name: f for f in type(opts).fields()}
    per_request = {}
    for name in type(opts).per_request():
        meta = fields[name].metadata
        kinds = [t for t in typing.get_args(hints[name]) or (hints[name],) if t is not type(None)]
        per_request[name] = {"type": _JSON_TYPES.get(kinds[0], "string") if kinds else "string",
                             "minimum": meta.get("lo"), "maximum": meta.get("hi"), "choices": meta.get("choices"),
                             "default": getattr(opts, name), "help": meta["help"]}
    if "num_speculative_tokens" in per_request:  # a request may lower K, not raise it past the server's
        per_request["num_speculative_tokens"] |= {"maximum": k, "default": k}
    return {"method": opts.method, "summary": opts.summary, "num_speculative_tokens": k,
            "adaptive": opts.adaptive, "per_request": per_request}


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
