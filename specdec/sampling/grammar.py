"""Structured output: a request's constraint (JSON schema, JSON object, regex, choice, grammar) and
the token masks that keep sampling inside it, with speculation.

The grammar engine is llguidance (Microsoft's, Rust; what vLLM and SGLang offer too): measured on this
CPU it compiles a JSON schema in ~3 ms and computes a mask and consumes a token in ~0.03 ms
(``python -m specdec.tools.bench.grammar`` compares it with xgrammar and outlines-core; BENCHMARKS.md).
We write no grammar engine of our own.

How it stays lossless under speculation (``block_masks``): at each position j of a verified block
the target's logits are masked by the matcher advanced through the row's draft tokens before j
(the matcher is rolled back afterwards; the accepted tokens are consumed by ``Sequence``'s owner
once they are kept), so every position sees exactly the legal set plain constrained decoding would
see. The mask acts as a logit processor: after penalties and logit bias, before temperature,
top-k, top-p and min-p, so the target's distribution is renormalised over the legal tokens. A
drafter samples through the same masks (``DraftMasks``), advanced through its own draft, so its q
is the masked, renormalised draft distribution and the rejection rule stays exact.

A position whose legal set is empty (the matcher has stopped: the grammar is complete, or after EOS)
allows the end-of-sequence tokens only, and so does every position after a drafted EOS: with
``ignore_eos`` plain decoding goes on emitting EOS there, and a verified block must see the same.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import SpecdecError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# compact JSON, the separators of json.dumps: no free whitespace (a small model's endless newlines
# are a known failure of flexible whitespace), and more of every object's text is forced
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint, vLLM's ``StructuredOutputsParams`` shape: set exactly one of

    json: a JSON schema (dict or its JSON text); json_object: any JSON object; regex: a regular
    expression (Rust regex syntax) the whole output matches; choice: the output is one of these
    strings; grammar: a Lark grammar (llguidance's dialect), or GBNF (``::=`` rules, as llama.cpp
    and xgrammar take), converted to Lark.
    """

    json: str | None = None  # the schema's canonical JSON text (a dict given is serialized)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", json.dumps(self.json))  # key order kept: it orders the output
        elif self.json is not None and not isinstance(self.json, str):
            raise SpecdecError(f"structured output 'json' must be a JSON schema object, got {self.json!r}")
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise SpecdecError("structured output takes exactly one of json, json_object, regex, choice, grammar; "
                               + (f"got {', '.join(set_)}" if set_ else "got none"))
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SpecdecError("structured output 'choice' must be a non-empty list of non-empty strings")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise SpecdecError(f"structured output {k!r} must be a non-empty string, got {v!r}")
        if self.json_object not in (True, False):
            raise SpecdecError(f"structured output 'json_object' must be true or false, got {self.json_object!r}")

    @classmethod
    def from_dict(cls, d: Any) -> "StructuredOutput":
        """From vLLM's ``structured_outputs`` dict (``{"json": {...}}``, ``{"regex": "..."}``, ...)."""
        if isinstance(d, StructuredOutput):
            return d
        if not isinstance(d, dict):
            raise SpecdecError(f"structured output must be an object with one of {', '.join(KINDS)}, got {d!r}")
        unknown = sorted(set(d) - set(KINDS))
        if unknown:
            raise SpecdecError(f"unknown structured output field(s) {', '.join(unknown)}: it takes one of "
                               f"{', '.join(KINDS)}")
        return cls(**d)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet validated)."""
        from llguidance import LLMatcher  # noqa: PLC0415 (the grammar engine loads on first use)
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark  # noqa: PLC0415

        kind = self.kind
        try:
            if kind == "json":
                return LLMatcher.grammar_from_json_schema(json.loads(self.json), defaults=JSON_OPTIONS)
            if kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if kind == "regex":
                return LLMatcher.grammar_from_regex(self.regex)
            if kind == "choice":  # Lark string literals take JSON's escapes
                return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
            text = gbnf_to_lark(self.grammar) if "::=" in self.grammar else self.grammar
            return LLMatcher.grammar_from_lark(text)
        except (ValueError, TypeError, RuntimeError, GbnfToLarkError) as e:
            raise SpecdecError(f"invalid structured output ({kind}): {e}") from e


class GrammarCompiler:
    """Turns constraints into matchers for one tokenizer; validated grammars are cached (LRU)."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        import llguidance.hf  # noqa: PLC0415

        # every EOS id of the model ends a grammar; the model's (padded) vocabulary sizes the masks
        self.eos_ids = sorted(tokenizer.eos_token_ids)
        self.vocab_size = vocab_size
        self.lltok = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size, eos_token=self.eos_ids)
        self._cache: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def grammar(self, so: StructuredOutput) -> str:
        """The validated llguidance grammar of ``so`` (cached); SpecdecError naming what is wrong."""
        from llguidance import LLMatcher  # noqa: PLC0415

        with self._lock:
            g = self._cache.get(so)
            if g is not None:
                self._cache.move_to_end(so)
                self.hits += 1
                return g
        g = so.llguidance_grammar()
        err = LLMatcher.validate_grammar(g, self.lltok)
        if err:
            raise SpecdecError(f"invalid structured output ({so.kind}): {' '.join(err.split())}")
        with self._lock:
            self.misses += 1
            self._cache[so] = g
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return g

    def matcher(self, so: StructuredOutput) -> "Matcher":
        from llguidance import LLMatcher  # noqa: PLC0415

        m = LLMatcher(self.lltok, self.grammar(so), log_level=0)
        if m.is_error():
            raise SpecdecError(f"invalid structured output ({so.kind}): {m.get_error()}")
        return Matcher(m, self.eos_ids, self.vocab_size)


class Matcher:
    """One request's grammar state: consumes kept tokens, computes masks, proposes forced tokens."""

    def __init__(self, m, eos_ids: list[int], vocab_size: int) -> None:
        self.m, self.eos_ids, self.vocab_size = m, eos_ids, vocab_size
        self.words = (vocab_size + 31) // 32

    def consume(self, tokens: list[int]) -> None:
        """The request kept ``tokens`` (each was legal: masks allowed only legal tokens)."""
        if not tokens or self.m.is_stopped():
            return
        n = self.m.try_consume_tokens(list(tokens))
        if n < len(tokens) and not self.m.is_stopped():  # tokens after EOS (ignore_eos) are past the grammar
            raise SpecdecError(f"the grammar rejected kept token {tokens[n]} {self.m.get_error()}".strip())

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar allows as the only continuation here (at most ``limit``)."""
        if limit <= 0 or self.m.is_stopped():
            return []
        return self.m.compute_ff_tokens()[:limit]

    def fill(self, out: torch.Tensor) -> None:
        """Write the legal set of the current state into ``out`` ((words,) int32 bit mask)."""
        self.m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        if not bool(out.any()):  # stopped: only the end of the sequence
            self.fill_eos(out)

    def fill_eos(self, out: torch.Tensor) -> None:
        """The legal set after the end of the sequence: the end again (what ``ignore_eos`` rows see)."""
        out.zero_()
        for e in self.eos_ids:
            out[e // 32] |= _bit(e % 32)

    def legal_prefix(self, path: list[int]) -> tuple[int, int]:
        """How many leading tokens of ``path`` are legal here, and how many of them the grammar
        consumes: those before its end (the first EOS, or here when the matcher has stopped). Past the
        end only EOS is legal, as plain decoding with ``ignore_eos`` emits it again and again. Tokens
        are checked, never consumed past an EOS: llguidance cannot roll back over a stop."""
        stopped = self.m.is_stopped()
        n = self.m.validate_tokens(list(path)) if path and not stopped else 0
        body = next((i for i, tok in enumerate(path[:n]) if tok in self.eos_ids), n)
        if body == n and not stopped:  # the end not reached within the legal tokens
            return n, n
        end = body  # path[body] is an EOS the grammar allows (or the matcher has stopped): then EOS only
        while end < len(path) and path[end] in self.eos_ids:
            end += 1
        return end, body

    def mask_after(self, path: list[int], out: torch.Tensor) -> None:
        """The legal set after ``path`` into ``out`` when all of ``path`` is legal (else ``out`` stays
        as it is: a position never reached). The matcher is left as it was, even if ``fill`` raises."""
        n, body = self.legal_prefix(path)
        if n < len(path):
            return
        if body < n:  # past the end: the end again
            self.fill_eos(out)
            return
        consumed = self.m.try_consume_tokens(list(path)) if path else 0
        try:
            self.fill(out)
        finally:
            if consumed:
                self.m.rollback(consumed)

    def masks_along(self, path: list[int], out: torch.Tensor) -> int:
        """Masks of the states before each token of ``path`` and after its last legal one, into
        ``out[0..n]`` (n+1 rows, n = how many of ``path`` are legal); rows after stay as they are.
        Every row past the grammar's end (an EOS, or a stopped matcher) is EOS only, the legal set
        plain decoding sees there (with ``ignore_eos``, decoding goes on). The matcher is left as it
        was, even if ``fill`` raises. Returns n."""
        n, body = self.legal_prefix(path)
        consumed = 0
        try:
            for j in range(body + 1):
                if j:
                    consumed += self.m.try_consume_tokens([path[j - 1]])
                self.fill(out[j])
        finally:
            if consumed:
                self.m.rollback(consumed)
        for j in range(body + 1, n + 1):
            self.fill_eos(out[j])
        return n


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32) if i == 31 else 1 << i  # an int32 word's bit i


def unpack(bits: torch.Tensor, V: int) -> torch.Tensor:
    """(..., words) int32 bit masks -> (..., V) bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    out = ((bits[..., None] >> shifts) & 1).bool().flatten(-2)  # (..., words * 32)
    if out.shape[-1] >= V:
        return out[..., :V]
    pad = torch.zeros(*out.shape[:-1], V - out.shape[-1], dtype=torch.bool, device=bits.device)
    return torch.cat([out, pad], -1)


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with disallowed tokens at -inf (a new float32 tensor)."""
    return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))


def block_masks(seqs, draft_ids: torch.Tensor, num_draft: torch.Tensor, parents: torch.Tensor | None,
                V: int) -> torch.Tensor | None:
    """(B, 1+K, V) bool: the legal tokens at each position of a verified block (None: no row is
    constrained). Position 0 follows the row's kept tokens, position j its draft's tokens before j
    (a tree: the node's ancestors). Positions past a row's first illegal draft token (never reached:
    the verifier rejects that token) and unconstrained rows allow everything."""
    if not any(s.matcher is not None for s in seqs):
        return None
    B, K = draft_ids.shape
    words = next(s.matcher.words for s in seqs if s.matcher is not None)
    bits = torch.full((B, 1 + K, words), -1, dtype=torch.int32)
    ids, nd = draft_ids.tolist(), num_draft.tolist()
    par = None if parents is None else parents.tolist()
    for b, s in enumerate(seqs):
        m = s.matcher
        if m is None:
            continue
        chain = ids[b][:nd[b]]
        if par is None:
            m.masks_along(chain, bits[b])
            continue
        m.fill(bits[b, 0])
        for i in range(nd[b]):  # node i: its ancestors' tokens then its own
            path, j = [], i
            while j >= 0:
                path.append(chain[j])
                j = par[b][j]
            path.reverse()
            m.mask_after(path, bits[b, 1 + i])
    return unpack(bits, V)


class DraftMasks:
    """A drafter's masks, position by position: ``apply(logits)`` masks the next draft token of
    each constrained row, ``advance(tokens)`` consumes the tokens just drafted, ``release()`` rolls
    every matcher back to the request's kept tokens."""

    def __init__(self, seqs) -> None:
        self.rows = [(b, s.matcher) for b, s in enumerate(seqs) if s.matcher is not None]
        self.consumed = {b: 0 for b, _ in self.rows}
        self.dead: set[int] = set()  # rows whose draft left the grammar (a padded row's garbage)
        self.ended: set[int] = set()  # rows that drafted an EOS (not consumed: see legal_prefix)

    @classmethod
    def from_seqs(cls, seqs) -> "DraftMasks | None":
        return cls(seqs) if any(s.matcher is not None for s in seqs) else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        B, V = logits.shape
        words = self.rows[0][1].words
        bits = torch.full((B, words), -1, dtype=torch.int32)
        for b, m in self.rows:
            if b in self.ended:
                m.fill_eos(bits[b])
            elif b not in self.dead:
                m.fill(bits[b])
        return apply_masks(logits, unpack(bits, V))

    def apply_after(self, logits: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        """``logits (B, V)`` masked to the legal set after each constrained row's kept tokens and then
        ``paths[b]`` (a tree node's tokens from the root's child down); a row whose path left the
        grammar stays unmasked (a node the verifier rejects anyway). The matchers are left as they were."""
        B, V = logits.shape
        bits = torch.full((B, self.rows[0][1].words), -1, dtype=torch.int32)
        p = paths.tolist()
        for b, m in self.rows:
            m.mask_after(p[b], bits[b])
        return apply_masks(logits, unpack(bits, V))

    def advance(self, tokens: torch.Tensor) -> None:
        toks = tokens.tolist()
        for b, m in self.rows:
            if b in self.dead or b in self.ended or m.m.is_stopped():
                continue
            if toks[b] in m.eos_ids:
                self.ended.add(b)
            elif m.m.try_consume_tokens([toks[b]]) == 1:
                self.consumed[b] += 1
            else:  # cannot happen for a masked draft; the row's later drafts are then unconstrained
                self.dead.add(b)

    def release(self) -> None:
        for b, m in self.rows:
            if self.consumed[b]:
                m.m.rollback(self.consumed[b])
            self.consumed[b] = 0
