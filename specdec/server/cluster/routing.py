"""Prefix affinity, the pure part: a request's route key and the replicas ranked for a key.

The key is what a conversation keeps from turn to turn: for a chat, the messages up to and including
the first user message (the system prompt and the opening question); for a completion, the start of
its first prompt. Both are cut at ``ROUTE_KEY_CHARS`` characters. Replicas are ranked by rendezvous
(highest random weight) hashing of (key, replica id): a key's first choice stays the same while the
set of replicas changes, except for the keys of a replica that left (they move to their second
choice) and a share 1/N of keys that move to a new replica. ``router.py`` turns the ranking into a
Ray Serve routing decision, with power-of-two choices on load when the first choice is busy.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

ROUTE_KEY_CHARS = 256  # characters of the conversation's opening that choose its replica


def route_key(path: str, body: bytes) -> str | None:
    """The route key of an OpenAI request body (None: route on load alone, e.g. a body that is not
    JSON: the replica answers it with its 400)."""
    try:
        req = json.loads(body) if body else None
    except ValueError:
        return None
    if not isinstance(req, dict):
        return None
    if path.endswith("/chat/completions"):
        opening = []
        for m in req.get("messages") or []:
            if not isinstance(m, dict):
                return None
            opening.append(f"{m.get('role')}:{_text(m.get('content'))}")
            if m.get("role") == "user":
                break
        key = "\n".join(opening)
    elif path.endswith("/completions"):
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # the first of several prompts (a list of strings or of token lists)
        key = prompt if isinstance(prompt, str) else json.dumps(prompt)[:ROUTE_KEY_CHARS]
    else:
        return None
    return key[:ROUTE_KEY_CHARS] or None


def _text(content) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def rank(key: str, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` ordered by preference for ``key`` (rendezvous hashing: stable, uniform)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{rid}".encode(), digest_size=8).digest()
    return sorted(replica_ids, key=weight, reverse=True)
