"""One request's state through the generation loop: tokens, stop conditions, statistics."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.sampling.logprobs import TokenLogprob, token_logprobs


@dataclass
class Sequence:
    """A prompt and what has been generated for it.

    The cache row holds keys/values of ``tokens[:-1]``; ``tokens[-1]`` is pending (see ModelRunner).
    """

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: object  # IncrementalDetokenizer
    eos_ids: frozenset[int]
    max_len: int  # the context limit: no token is generated at position >= max_len
    seed: int  # keys every random draw of the request (sampling.rng): drawn by the LLM when none is given
    row: int = -1
    num_speculative_tokens: int | None = None  # per-request cap on the draft length (0: no drafts)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # statistics
    t_start: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_end: float | None = None
    num_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    num_draft: int = 0
    num_accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted count by draft position
    drafted_at: list[int] = field(default_factory=list)  # drafted count by draft position
    spec_off: str | None = None  # why the last step drafted nothing for it (the server's playground says it)
    # raw model logprobs (params.logprobs / prompt_logprobs): one per output token, one per prompt
    # token after the first (the first has no context)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    matcher: object | None = None  # sampling.grammar.Matcher of a constrained request (its kept tokens)

    def __post_init__(self) -> None:
        self.tokens: list[int] = list(self.prompt_ids) + list(self.output_ids)  # prompt + output, kept in step

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def stop_len(self) -> int:
        """The longest stop string's length: how far back a new token's text can complete one (a
        stream holds back one character less)."""
        return max(map(len, self.params.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def room(self) -> int:
        """How many more tokens this sequence may still generate."""
        return min(self.params.max_tokens - len(self.output_ids), self.max_len - self.num_tokens)

    def add_prompt_logprobs(self, position: int, logits: torch.Tensor) -> None:
        """Prefill logits (T, V) of the tokens at ``position..``: the logprobs of the prompt tokens after
        them. Positions already covered, and output tokens (a preempted request's prefill runs again
        over its prompt and output), add nothing."""
        lo = max(position, len(self.prompt_logprobs))
        hi = min(position + logits.shape[0], len(self.prompt_ids) - 1)
        if hi <= lo:
            return
        nxt = torch.tensor(self.tokens[lo + 1:hi + 1], device=logits.device)  # (hi - lo,)
        self.prompt_logprobs.extend(token_logprobs(logits[lo - position:hi - position], nxt,
                                                   self.params.prompt_logprobs or 0))

    def append(self, token_ids: list[int]) -> int:
        """Add accepted tokens one by one, stopping at EOS, a stop string or a length limit.

        Returns how many were taken; tokens after a stop are dropped.
        """
        taken = 0
        for tok in token_ids:
            if self.finished:
                break
            self.output_ids.append(tok)
            self.tokens.append(tok)
            taken += 1
            if self.matcher is not None:  # the grammar follows the kept tokens
                self.matcher.consume([tok])
            if self.t_first is None:
                self.t_first = time.perf_counter()
            if tok in self.eos_ids and not self.params.ignore_eos:
                self.finish("stop", tok)
                break
            delta = self.detokenizer.feed([tok])
            self.text += delta
            if self.params.stop and delta and self._check_stop_strings(len(delta)):
                break
            if self.room <= 0:
                self.finish("length", None)
        return taken

    def _check_stop_strings(self, delta_len: int) -> bool:
        """Whether a stop string ends in the last ``delta_len`` characters (then the text is cut before
        the first one and the sequence finishes). One ``find`` per stop string over a window of
        ``delta_len + stop_len - 1`` characters: the server bounds both (protocol.MAX_STOP, MAX_STOP_CHARS)."""
        text = self.text
        window_start = max(0, len(text) - delta_len - self.stop_len + 1)
        hits = [(i, s) for s in self.params.stop if (i := text.find(s, window_start)) >= 0]
        if not hits:
            return False
        idx, s = min(hits)
        self.text = self.text[:idx]
        self.finish("stop", s)
        return True

    def finish(self, reason: str, stop_reason: str | int | None) -> None:
        if not isinstance(stop_reason, str):  # a stop string already cut the text: nothing to flush
            self.text += self.detokenizer.flush()
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.t_end = time.perf_counter()
