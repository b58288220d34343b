"""Tool calling: the model's own tool-call format <-> OpenAI ``tool_calls``.

Qwen2.5's chat template (and every Hermes-style one) tells the model to answer a tool call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. ``ToolCallParser`` reads the generated text as it streams: text outside the
blocks is the message content, each complete block whose JSON is ``{"name": str, "arguments":
object}`` is a call. A block that does not parse stays content (the client sees what the model
wrote, never a call it did not make). Trailing whitespace is held back until real text follows
it (whitespace right before a block, or at the end after a call, is dropped), so the streamed
deltas joined are exactly the non-streamed message. A model whose template has no ``<tool_call>``
format gets a 400 for ``tools``.

``tool_choice`` ``required`` or a named function constrains the output (``tool_call_grammar``): a
Lark grammar, llguidance's dialect, whose sentences are exactly such blocks, each one's JSON a
declared (or the named) function with arguments valid for its ``parameters`` schema.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from specdec.sampling.grammar import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def supports_tools(chat_template: str | None) -> bool:
    """The template renders ``tools`` and asks for ``<tool_call>`` blocks (Qwen2.5, Hermes)."""
    return bool(chat_template) and OPEN in chat_template and "tools" in chat_template


def tags_are_tokens(tokenizer) -> bool:
    """Both tags are tokens of their own (added tokens, as in Qwen2.5), not text spelled by others."""
    added = tokenizer.hf.get_added_vocab()
    return OPEN in added and CLOSE in added


def tool_call_grammar(functions: list[dict], name: str | None = None, parallel: bool = True,
                      special_tags: bool = False) -> str:
    """A grammar of tool calls in the model's own format: one ``<tool_call>`` block (``parallel``:
    one or more, a newline apart), its JSON ``{"name": ..., "arguments": {...}}`` calling one of
    ``functions`` (OpenAI function definitions), or only ``name``, with arguments valid for that
    function's ``parameters``. ``special_tags``: the tags are written as the tokenizer's own tokens
    (``tags_are_tokens``), else as text."""
    chosen = [f for f in functions if name is None or f["name"] == name]
    if not chosen:
        raise ValueError(f"no function named {name!r}")
    tag = (lambda t: t) if special_tags else json.dumps
    rules = ["start: call" + (' ("\\n" call)*' if parallel else ""),
             f'call: {tag(OPEN)} "\\n" ({" | ".join(f"f{i}" for i in range(len(chosen)))}) "\\n" {tag(CLOSE)}']
    rules += [f"f{i}: %json {json.dumps(_call_schema(f), ensure_ascii=False)}" for i, f in enumerate(chosen)]
    return "\n".join(rules)


def _call_schema(function: dict) -> dict:
    """The JSON schema of one call of ``function``: its name, then its arguments. The parameters'
    definitions move to the root (their ``$ref`` stay valid); other local references get the path
    of the arguments in front."""
    params = dict(function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False})
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    params.pop("$schema", None)
    params.setdefault("type", "object")  # a call's arguments are an object, whatever the schema leaves open
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": _rebase(params)},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_OPTIONS} | defs


def _rebase(node: Any) -> Any:
    if isinstance(node, list):
        return [_rebase(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rebase(v) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = "#/properties/arguments" + ref[1:]
    return out


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index} | d


def _parse_block(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str) -> int:
    """Length of the longest suffix of ``text`` that may be the start of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _bare_calls(text: str, names: frozenset[str]) -> list[ParsedCall] | None:
    """``text`` as nothing but JSON call objects naming declared tools (whitespace between), or None."""
    dec, i, calls = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        call = _parse_block(json.dumps(obj)) if isinstance(obj, dict) and obj.get("name") in names else None
        if call is None:
            return None
        calls.append(call)


class ToolCallParser:
    """Generated text deltas in, (content delta, new calls) out; ``finish`` at the end.

    ``parallel=False`` (OpenAI's ``parallel_tool_calls: false``) keeps the first call only.
    ``names``: the declared tools. Small models often drop the tags and answer with the bare JSON
    (Qwen2.5-Coder-0.5B does): a message that starts with ``{`` is held to its end, and is a call
    only if it is nothing but call objects naming declared tools.
    """

    def __init__(self, parallel: bool = True, names: frozenset[str] = frozenset()) -> None:
        self.parallel, self.names = parallel, names
        self.buf = ""  # text not yet decided
        self.inside = False  # buf is the body of an open block
        self.bare: bool | None = None  # the message starts with "{" (None: nothing but whitespace yet)
        self.calls: list[ParsedCall] = []

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.buf += delta
        if self.bare is None and self.buf.strip():
            self.bare = bool(self.names) and self.buf.lstrip().startswith("{")
        if self.bare is not False:
            return "", []  # held: whitespace so far, or a message that may be a bare call
        content, new = "", []
        while True:
            if self.inside:
                end = self.buf.find(CLOSE)
                if end < 0:
                    return content, new
                body, self.buf, self.inside = self.buf[:end], self.buf[end + len(CLOSE):], False
                content += self._block(body, new, closed=True)
            else:
                start = self.buf.find(OPEN)
                if start < 0:
                    keep = _held_prefix(self.buf)
                    text = self.buf[:len(self.buf) - keep]
                    done = text.rstrip()  # trailing whitespace waits: dropped before a block
                    content += done
                    self.buf = self.buf[len(done):]
                    return content, new
                content += self.buf[:start].rstrip()
                self.buf, self.inside = self.buf[start + len(OPEN):], True

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The end of the text: an unclosed block still counts if its JSON is complete."""
        new: list[ParsedCall] = []
        if self.bare:
            calls = _bare_calls(self.buf, self.names)
            if calls is not None:
                new = calls if self.parallel else calls[:1]
                self.calls += new
                self.buf = ""
                return "", new
            self.bare = False
            content, new = self.feed("")
            rest, more = self.finish()
            return content + rest, new + more
        if self.inside:
            content = self._block(self.buf, new, closed=False)
        else:
            content = self.buf if (self.buf.strip() or not self.calls) else ""
        self.buf, self.inside = "", False
        return content, new

    def _block(self, body: str, new: list[ParsedCall], closed: bool) -> str:
        call = _parse_block(body)
        if call is None:
            return OPEN + body + (CLOSE if closed else "")
        if self.parallel or not self.calls:
            self.calls.append(call)
            new.append(call)
        return ""


def parse_tool_calls(text: str, parallel: bool = True, names: frozenset[str] = frozenset()
                     ) -> tuple[str | None, list[ParsedCall]]:
    """A whole message: (content, None when empty and calls were made; the calls)."""
    p = ToolCallParser(parallel, names)
    content, calls = p.feed(text)
    rest, more = p.finish()
    content += rest
    calls += more
    return (content or None) if calls else content, calls
