"""Two tokenizers' vocabularies side by side: each token's bytes, and the tokens both share.

A drafter with another tokenizer than the target's (``proposers.cross_vocab``) works on the text
itself: the committed target tokens become bytes, the bytes become the drafter's tokens, and a
drafted text becomes target tokens again. Working in bytes rather than decoded strings keeps the
byte-level BPE pieces exact: a target token holding half of a UTF-8 character is two bytes, not a
U+FFFD, so the text the drafter reads is the target's text, byte for byte, up to any unfinished
character at its very end (held back until the next token completes it).

Added tokens (``<|im_start|>``, ``<|endoftext|>``) are their content; they match only an added
token of the other tokenizer with the same content (a chat template's markers are shared by
SmolLM2 and Qwen2.5), never a run of ordinary tokens spelling the same characters.
"""
from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from functools import lru_cache

import torch

from specdec.errors import SpecdecError


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _decoder_kind(hf) -> str:
    """'bytelevel' (GPT-2 style: Qwen, Llama 3, SmolLM) or 'sentencepiece' (U+2581 spaces, <0xXX>
    byte fallback: Llama 2, Mistral); anything else has no exact token -> bytes map here."""
    dec = json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {dec.get("type")} | {d.get("type") for d in dec.get("decoders", [])}
    if "ByteLevel" in kinds:
        return "bytelevel"
    if kinds & {"Metaspace", "ByteFallback", "Replace"}:
        return "sentencepiece"
    raise SpecdecError(f"a drafter with another tokenizer needs byte-level BPE or SentencePiece vocabularies; "
                       f"this tokenizer's decoder is {dec.get('type')!r}")


def token_bytes(hf, size: int) -> tuple[list[bytes], list[bool]]:
    """Per token id below ``size``: its bytes, and whether it is an added token (its content).
    Ids the tokenizer does not define (an embedding padded past the vocabulary) are empty."""
    kind = _decoder_kind(hf)
    added = {i: t.content for i, t in hf.added_tokens_decoder.items()}
    out, is_added = [b""] * size, [False] * size
    bd = _byte_decoder()
    for tok, i in hf.get_vocab().items():
        if i >= size:
            continue
        if i in added:
            out[i], is_added[i] = added[i].encode(), True
        elif kind == "bytelevel":
            out[i] = bytes(bd[c] for c in tok) if all(c in bd for c in tok) else tok.encode()
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            out[i] = bytes([int(tok[3:5], 16)])
        else:
            out[i] = tok.replace("\u2581", " ").encode()
    return out, is_added


def clean_text(data: bytes) -> tuple[str, int]:
    """``data`` as text without an unfinished UTF-8 character at its end; returns the text and how
    many bytes it covers (invalid bytes elsewhere become U+FFFD, as decoding does)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = dec.decode(data, final=False)
    return text, len(data) - len(dec.getstate()[0])


@dataclass
class VocabPair:
    """A drafter's and a target's vocabularies: bytes tables, the shared tokens, and text round trips.

    ``shared_draft[i]`` and ``shared_target[i]`` are the same token (the same bytes; added tokens by
    content) in each vocabulary: the token-level intersection of Timor et al. (ICML 2025). A target
    added token the drafter lacks reads as nothing to the drafter; a drafted added token the target
    lacks ends the drafted text.
    """

    draft_hf: object
    target_hf: object
    draft_bytes: list[bytes]
    draft_added: list[bool]
    target_bytes: list[bytes]
    target_added: list[bool]
    shared_draft: torch.Tensor  # (S,) long
    shared_target: torch.Tensor  # (S,) long

    @classmethod
    def build(cls, draft_hf, draft_size: int, target_hf, target_size: int) -> "VocabPair":
        db, da = token_bytes(draft_hf, draft_size)
        tb, ta = token_bytes(target_hf, target_size)
        t_index: dict[tuple[bool, bytes], int] = {}
        for i, (b, a) in enumerate(zip(tb, ta)):
            if b:
                t_index.setdefault((a, b), i)
        pairs, seen = [], set()
        for i, (b, a) in enumerate(zip(db, da)):
            t = t_index.get((a, b)) if b else None
            if t is not None and t not in seen:  # one draft id per target id: q stays a distribution
                seen.add(t)
                pairs.append((i, t))
        if not pairs:
            raise SpecdecError("the draft and target vocabularies share no token")
        d, t = zip(*pairs)
        draft_contents = {b for b, a in zip(db, da) if a}
        target_contents = {b for b, a in zip(tb, ta) if a}
        # added tokens the other side lacks: nothing to the drafter / the end of a drafted text
        tb = [b"" if a and b not in draft_contents else b for b, a in zip(tb, ta)]
        da = [a and b not in target_contents for b, a in zip(db, da)]  # now: "ends a drafted text"
        return cls(draft_hf, target_hf, db, da, tb, ta, torch.tensor(d), torch.tensor(t))

    def target_text(self, ids: list[int]) -> bytes:
        return b"".join(self.target_bytes[i] for i in ids)

    def draft_text(self, ids: list[int]) -> tuple[bytes, int]:
        """The bytes of drafted ids up to the first one the target cannot spell, and how many ids."""
        for n, i in enumerate(ids):
            if self.draft_added[i]:
                return b"".join(self.draft_bytes[j] for j in ids[:n]), n
        return b"".join(self.draft_bytes[j] for j in ids), len(ids)

    def encode_draft(self, text: str) -> list[int]:
        return list(self.draft_hf.encode(text, add_special_tokens=False)) if text else []

    def encode_target(self, text: str) -> list[int]:
        return list(self.target_hf.encode(text, add_special_tokens=False)) if text else []

    def draft_lead(self) -> list[int]:
        """What the drafter's tokenizer puts before any text (its BOS), for a context at position 0."""
        return list(self.draft_hf.encode("", add_special_tokens=True))

    def aligned(self, target_ids: list[int], draft_ids: list[int], upto: int) -> tuple[int, int]:
        """The last point (i, j) with ``i <= upto`` where target_ids[:i] and draft_ids[:j] spell the
        same bytes (both tokenizations of one text): where a drafter's context may be frozen."""
        best, i, j, ti, dj = (0, 0), 0, 0, 0, 0
        while True:
            if ti == dj:
                if i > upto:
                    break
                best = (i, j)
                if i == len(target_ids):
                    break
                ti += len(self.target_bytes[target_ids[i]])
                i += 1
            elif ti < dj:
                if i == len(target_ids):
                    break
                ti += len(self.target_bytes[target_ids[i]])
                i += 1
            else:
                if j == len(draft_ids):
                    break
                dj += len(self.draft_bytes[draft_ids[j]])
                j += 1
        return best
