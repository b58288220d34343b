"""Greedy acceptance of a draft model, computed exactly from the target's own outputs.

Under greedy decoding a chain draft of K tokens is kept up to its first token that differs from the
target's argmax, and the target's argmax is the token it emitted. So what speculative decoding with a
draft model would accept on a request follows from two things: the target's greedy output ``O`` for
the prompt ``P``, and whether the draft's argmax after ``P + O[:j]`` is ``O[j]`` for each j. One
teacher-forced forward of the draft over ``P + O`` gives every such argmax; walking the steps as the
engine takes them (the prefill stops before the prompt's last token; each step feeds the pending token,
drafts ``min(K, room - 1)`` tokens, keeps the leading matches and adds the target's own next token) gives the counters the engine reports, at the
cost of one draft prefill instead of a whole speculative run of the target (``tests/train`` checks the
walk against the engine). The draft's tokens here are its argmax after the true prefix, which is what
it drafts as long as its earlier tokens matched; a draft's own incremental decoding can round
differently from its one-pass prefill at near ties, so ``specdec distill`` reports these figures as
computed, and the real engine measures speed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.engine.accounting import StepCounts, count_step


@dataclass
class Acceptance:
    """Counters of simulated greedy chain drafting (the engine's own names), counted by the engine's
    own ``engine.accounting.count_step``."""

    k: int
    sequences: int = 0
    generated: int = 0  # output tokens
    counts: StepCounts = field(default_factory=StepCounts)

    @property
    def steps(self) -> int:
        """Target verification steps."""
        return self.counts.num_steps

    @property
    def drafted(self) -> int:
        return self.counts.num_draft

    @property
    def accepted(self) -> int:
        return self.counts.num_accepted

    @property
    def drafted_by_position(self) -> list[int]:
        return self.counts.drafted_at

    @property
    def accepted_by_position(self) -> list[int]:
        return self.counts.accepted_at

    def add(self, matches: list[bool], max_tokens: int) -> None:
        """One request: ``matches[j]`` is whether the draft's argmax after ``P + O[:j]`` is ``O[j]``;
        ``max_tokens`` the request's limit."""
        n = len(matches)
        self.sequences += 1
        self.counts.widen(self.k)
        emitted = 0
        while emitted < n:
            k = max(0, min(self.k, max_tokens - emitted - 1))
            kept = 0  # what the verifier keeps (the output ends at O's last token: nothing known past it)
            while kept < k and emitted + kept < n and matches[emitted + kept]:
                kept += 1
            taken = min(kept + 1, n - emitted)  # the output stops inside the draft: no token of the target's
            count_step(self.counts, k, kept, taken)
            emitted += taken
        self.generated += n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per target step (accepted drafts plus the target's own)."""
        return self.generated / self.steps if self.steps else 0.0

    def summary(self) -> dict:
        return {"k": self.k, "sequences": self.sequences, "tokens": self.generated, "steps": self.steps,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_accepted_length": round(self.mean_accepted_length, 3),
                "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in
                                           zip(self.accepted_by_position, self.drafted_by_position)]}


@torch.inference_mode()
def draft_matches(runner, prompt_ids: list[int], output_ids: list[int]) -> list[bool]:
    """``matches`` for :meth:`Acceptance.add`: the draft (a ``ModelRunner`` with a cache row 0 long
    enough) teacher-forced over prompt + output, its argmax compared with each output token."""
    ids = list(prompt_ids) + list(output_ids[:-1])
    argmax: list[int] = []

    def keep(position: int, logits: torch.Tensor) -> None:
        argmax.extend(logits.argmax(-1).tolist())

    runner.prefill(0, ids, on_logits=keep)
    p = len(prompt_ids)
    # argmax[i] predicts token i + 1 of ids; output token j sits at ids position p + j
    return [argmax[p + j - 1] == output_ids[j] for j in range(len(output_ids))]


def measure(draft, pairs: list[tuple[list[int], list[int], int]], k: int) -> Acceptance:
    """Acceptance of ``draft`` (a ``LoadedModel``) on ``(prompt_ids, output_ids, max_tokens)`` triples."""
    from specdec.models.runner import ModelRunner  # noqa: PLC0415

    runner = ModelRunner(draft.model)
    longest = max((len(p) + len(o) for p, o, _ in pairs), default=1)
    runner.ensure_cache(1, longest + 1)
    acc = Acceptance(k)
    for prompt_ids, output_ids, max_tokens in pairs:
        if output_ids:
            acc.add(draft_matches(runner, prompt_ids, output_ids), max_tokens)
    return acc
