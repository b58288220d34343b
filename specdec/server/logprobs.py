"""OpenAI's logprobs objects from the engine's ``TokenLogprob`` lists (sampling/logprobs.py).

The values are the target model's raw log-probabilities (before penalties, bias, temperature and
filters; vLLM's default), computed from the verification forward, so they are the same with
speculation on and off. Token strings are each token decoded alone (special tokens kept); ``bytes``
are that string's UTF-8 bytes.
"""
from __future__ import annotations

from specdec.formats.tokenizer import Tokenizer
from specdec.sampling.logprobs import TokenLogprob


class LogprobFormatter:
    """Formats logprobs for chat (``{"content": [...]}``) and completions (``tokens``, ...)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def _entry(self, token_id: int, logprob: float) -> dict:
        s = self.token(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    def chat(self, lps: list[TokenLogprob]) -> dict:
        """A chat choice's (or chunk's) ``logprobs``."""
        return {"content": [self._entry(t.token_id, t.logprob)
                            | {"top_logprobs": [self._entry(i, v) for i, v in t.top]} for t in lps],
                "refusal": None}

    def completion(self, lps: list[TokenLogprob], offset: int = 0, first: int | None = None) -> dict:
        """A completion choice's ``logprobs``; ``first``: with echo, the prompt's first token, which has no
        context (its logprob is null). ``offset``: the text position of the first token."""
        tokens, values, tops, offsets = [], [], [], []
        if first is not None:
            s = self.token(first)
            tokens.append(s)
            values.append(None)
            tops.append(None)
            offsets.append(offset)
            offset += len(s)
        for t in lps:
            s = self.token(t.token_id)
            tokens.append(s)
            values.append(t.logprob)
            tops.append({s: t.logprob} | {self.token(i): v for i, v in t.top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
