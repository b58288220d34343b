"""How many prompt tokens a step may prefill while other requests decode: a time budget.

A prompt chunk that rides a decode step's forward (``EngineCore._riding_chunks``) makes that step
longer for every stream in the batch. ``--max-prefill-tokens`` caps the chunk in tokens, but what a
token costs depends on the model, its weights' format and the machine: 512 tokens of the 135M model
on this CPU made each step of four streams 6x longer. ``PrefillPacer`` sizes each step's prompt
tokens from measured step times instead, so that a step with a chunk takes at most ``slowdown``
times a step without one (Sarathi-Serve's stall-free batching, with the token budget found from
measurements rather than set by hand): streams keep ``1 / slowdown`` of their speed while a long
prompt is prefilled beside them, and the prompt goes as fast as that allows.

Two running means, both per batch size (a step of 8 rows costs more than one of 2):
- a decode-only step's seconds;
- the seconds a riding prompt token adds to a step (a step's time minus the decode-only mean, over
  its prompt tokens).
The budget is ``(slowdown - 1) * decode step / per-token cost``, in whole chunks, at least one chunk
(the prompt always moves) and at most ``cap``. Until a batch size has both means the budget is one
chunk: the first steps measure. Without running streams the cap applies (nothing to slow down).
A decode step's cost grows as the streams' contexts do, so every ``REFRESH``-th step beside a prompt
prefills nothing and measures it again (the prompt loses 1/REFRESH of its pace; the streams gain).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8  # weight of the running mean against a new measurement
REFRESH = 8  # one step in this many beside a prompt is decode-only: it measures the decode step again


@dataclass
class PrefillPacer:
    slowdown: float  # a step with prompt tokens takes at most this times one without (> 1)
    cap: int  # --max-prefill-tokens: prompt tokens in one step, at most
    quantum: int  # the runner's prefill chunk: budgets are whole chunks
    decode_s: dict[int, float] = field(default_factory=dict)  # batch size -> mean decode-only step seconds
    token_s: dict[int, float] = field(default_factory=dict)  # batch size -> mean seconds per riding token
    paced: int = 0  # steps paced beside decoding streams so far

    def __post_init__(self) -> None:
        if not self.slowdown > 1.0:
            raise ValueError(f"the prefill slowdown must be > 1 (a step with a prompt chunk takes at most that "
                             f"times one without), got {self.slowdown}")
        if self.quantum < 1 or self.cap < self.quantum:
            raise ValueError(f"the prefill cap ({self.cap}) must be at least one chunk ({self.quantum})")

    def budget(self, batch: int) -> int:
        """Prompt tokens the next step may prefill beside ``batch`` decoding rows (0: none, this step
        measures the decode step)."""
        if batch == 0:
            return self.cap
        self.paced += 1
        if self.paced % REFRESH == 0 and batch in self.token_s:
            return 0  # a decode-only step: its time refreshes the baseline
        step, per_token = self.decode_s.get(batch), self.token_s.get(batch)
        if step is None or per_token is None:
            return self.quantum
        tokens = (self.slowdown - 1.0) * step / max(per_token, 1e-9)
        return max(self.quantum, min(self.cap, int(tokens) // self.quantum * self.quantum))

    def observe(self, batch: int, seconds: float, prompt_tokens: int) -> None:
        """A step of ``batch`` decoding rows took ``seconds`` with ``prompt_tokens`` riding."""
        if batch == 0:
            return
        if prompt_tokens == 0:
            self.decode_s[batch] = _mean(self.decode_s.get(batch), seconds)
        elif batch in self.decode_s:
            extra = max(0.0, seconds - self.decode_s[batch])
            self.token_s[batch] = _mean(self.token_s.get(batch), extra / prompt_tokens)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1.0 - DECAY) * new
