"""Penalties and logit bias: the per-row, per-position logits transform before temperature.

Definitions, as OpenAI and vLLM state them, applied in vLLM's order:

* ``logit_bias`` {token: b}: b is added to that token's logit (OpenAI: values in [-100, 100]).
* ``repetition_penalty`` r (Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model for
  Controllable Generation", in vLLM's form): a token that appears in the prompt or in the output so
  far has its logit divided by r where it is positive and multiplied by r where it is not; 1 = off.
* ``frequency_penalty`` f and ``presence_penalty`` a (OpenAI): with c[v] the times token v appears
  in the output so far, logit[v] -= c[v] * f + (c[v] > 0) * a; in [-2, 2], 0 = off.

Under speculation the "output so far" at verified position j of a block includes the draft tokens
before j, so every position scores exactly what plain decoding would have scored there, and a
drafter uses the same transform for its q as the target for its p (``extra`` below).

Only the tokens a row has seen (prompt, output, draft) or biases are touched: the work is
proportional to those, never to the vocabulary, and a batch in which no row has a penalty or a bias
skips this module entirely (``Penalties.from_seqs`` returns None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch
from torch import Tensor

from specdec.runtime.sequence import Sequence


@dataclass(frozen=True)
class _Row:
    """One row's penalty state before the block: sorted unique ids and what is known of them."""

    out_ids: Tensor  # (M1,) long, sorted unique output tokens
    out_counts: Tensor  # (M1,) float32, their counts
    prompt_ids: Tensor  # (M2,) long, sorted unique prompt tokens (empty when repetition is off)
    bias_ids: Tensor  # (M3,) long, sorted
    bias: Tensor  # (M3,) float32
    repetition: float
    frequency: float
    presence: float


class Penalties:
    """The penalty state of a batch: ``apply(logits, extra)`` gives the processed logits."""

    def __init__(self, rows: list[_Row | None]) -> None:
        self.rows = rows

    @classmethod
    def from_seqs(cls, seqs: Seq[Sequence], device: torch.device | str = "cpu") -> "Penalties | None":
        """The state of ``seqs`` (output = tokens after ``prompt_ids``); None when no row needs one."""
        if not any(s.params.has_penalties for s in seqs):
            return None
        return cls([_row(s, device) if s.params.has_penalties else None for s in seqs])

    def apply(self, logits: Tensor, extra: Tensor | None = None) -> Tensor:
        """logits (B, V) or (B, T, V) -> float32 processed logits of the same shape (a new tensor).

        extra (B, E) long: tokens that follow each row's sequence (drafts; negative = padding).
        Position t of a T-position block counts ``extra[:, :E - T + 1 + t]``: a verification block
        (T = K + 1 over K drafts) counts the drafts before each position, a drafter's single
        position (T = 1) counts everything it drafted so far.
        """
        x = logits.to(torch.float32, copy=True)  # one copy: the raw logits stay for logprobs
        x = x if logits.dim() == 3 else x[:, None]  # (B, T, V)
        T = x.shape[1]
        E = 0 if extra is None else extra.shape[1]
        if E < T - 1:
            raise ValueError(f"{E} extra tokens cannot precede {T} positions")
        for b, row in enumerate(self.rows):
            if row is not None:
                x[b] = _apply_row(x[b], row, extra[b] if E else None, T)
        return x if logits.dim() == 3 else x[:, 0]


def _row(s: Sequence, device: torch.device | str) -> _Row:
    p = s.params
    n_prompt = len(s.prompt_ids)
    out = torch.tensor(s.tokens[n_prompt:], dtype=torch.long, device=device)
    out_ids, out_counts = torch.unique(out, return_counts=True)
    prompt = (torch.unique(torch.tensor(s.prompt_ids, dtype=torch.long, device=device))
              if p.repetition_penalty != 1.0 else torch.zeros(0, dtype=torch.long, device=device))
    bias = sorted((p.logit_bias or {}).items())
    return _Row(out_ids=out_ids, out_counts=out_counts.float(), prompt_ids=prompt,
                bias_ids=torch.tensor([t for t, _ in bias], dtype=torch.long, device=device),
                bias=torch.tensor([v for _, v in bias], dtype=torch.float32, device=device),
                repetition=float(p.repetition_penalty), frequency=float(p.frequency_penalty),
                presence=float(p.presence_penalty))


def _lookup(keys: Tensor, values: Tensor | None, query: Tensor) -> Tensor:
    """values[keys == q] for each q in ``query`` (0 where absent; membership when values is None)."""
    if keys.numel() == 0:
        return torch.zeros(query.shape, dtype=torch.float32 if values is not None else torch.bool,
                           device=query.device)
    i = torch.searchsorted(keys, query).clamp(max=keys.numel() - 1)  # (M,)
    hit = keys[i] == query
    return hit if values is None else torch.where(hit, values[i], 0.0)


def _apply_row(x: Tensor, row: _Row, extra: Tensor | None, T: int) -> Tensor:
    """x (T, V) float32 of one row -> the same, penalized and biased on the tokens involved."""
    e = extra[extra >= 0] if extra is not None else extra  # (E',) padding dropped
    ctx_len = 0 if extra is None else extra.shape[0] - T + 1  # extra tokens before position 0
    parts = [row.out_ids, row.prompt_ids, row.bias_ids] + ([e] if e is not None else [])
    cand = torch.unique(torch.cat(parts))  # (M,) sorted: every token whose logit may change
    cand = cand[cand < x.shape[-1]]  # a drafter's vocabulary may be padded less than the target's
    if cand.numel() == 0:
        return x
    counts = _lookup(row.out_ids, row.out_counts, cand)[None].expand(T, -1)  # (T, M)
    if extra is not None and extra.shape[0]:
        eq = (extra[:, None] == cand[None, :]).float()  # (E, M); padding (< 0) matches nothing
        before = torch.cat([torch.zeros(1, cand.numel(), device=x.device), eq.cumsum(0)])  # (E+1, M)
        counts = counts + before[ctx_len:ctx_len + T]  # (T, M) position t counts extra[:ctx_len + t]
    v = x[:, cand] + _lookup(row.bias_ids, row.bias, cand)[None]  # (T, M)
    if row.repetition != 1.0:
        seen = _lookup(row.prompt_ids, None, cand)[None] | (counts > 0)  # (T, M)
        v = torch.where(seen, torch.where(v > 0, v / row.repetition, v * row.repetition), v)
    if row.frequency != 0.0:
        v = v - row.frequency * counts
    if row.presence != 0.0:
        v = v - row.presence * (counts > 0).float()
    x[:, cand] = v
    return x
