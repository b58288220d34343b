"""The one generation loop: propose -> verify -> accept, for plain and speculative decoding alike.

Plain decoding is the loop with no proposer: every step verifies an empty draft and emits the
target's own next token (the "bonus" token of an empty chain).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.outputs import RequestMetrics
from specdec.runtime.runner import ModelRunner
from specdec.runtime.sequence import Sequence
from specdec.sampling import RowGenerators, SamplingTensors, logits_to_probs
from specdec.verify.rejection import verify_greedy, verify_sampled


@dataclass
class StepTimes:
    draft: float = 0.0
    verify: float = 0.0
    other: float = 0.0


@dataclass
class Engine:
    """Runs a set of sequences to completion, one batched step at a time.

    ``add`` prefills a sequence into a free cache row; ``step`` advances every running sequence by
    one verification step; finished sequences leave the batch and free their row at once.
    """

    runner: ModelRunner
    proposer: object | None = None  # spec.base.Proposer
    k_policy: object | None = None  # spec.adaptive.FixedK / AdaptiveK: tokens to draft per row
    running: list[Sequence] = field(default_factory=list)
    times: StepTimes = field(default_factory=StepTimes)

    def free_rows(self) -> list[int]:
        used = {s.row for s in self.running}
        return [r for r in range(self.runner.cache.rows) if r not in used]

    def add(self, seq: Sequence) -> None:
        """Prefill ``seq`` (all its tokens but the pending last one) into a free cache row."""
        free = self.free_rows()
        if not free:
            raise RuntimeError("no free KV cache row")
        seq.row = free[0]
        t0 = time.perf_counter()
        self.runner.prefill(seq.row, seq.tokens[:-1])
        if self.proposer is not None:
            self.proposer.add(seq)
        self.times.other += time.perf_counter() - t0
        self.running.append(seq)

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq`` now (finish reason "abort") and free its cache row, as ``step`` does for
        finished sequences. A sequence not in the batch is only marked finished."""
        if not seq.finished:
            seq.finish("abort", None)
        if any(s is seq for s in self.running):
            self.running = [s for s in self.running if s is not seq]
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Drop the proposer's and the draft-length policy's state of a sequence leaving the batch."""
        if self.proposer is not None:
            self.proposer.remove(seq)
            self.k_policy.forget(seq)

    def step(self) -> list[Sequence]:
        """One propose -> verify -> accept step over all running sequences. Returns them."""
        seqs = self.running
        if not seqs:
            return []
        device = self.runner.device
        t0 = time.perf_counter()
        B = len(seqs)
        ks = [self.k_policy.k_for(s, B) for s in seqs] if self.proposer is not None else [0] * B
        if any(ks) and self.k_policy.needs_plain_step(B):
            ks = [0] * B  # one plain step per batch size tells the policy what drafting must beat
        draft = self.proposer.propose(seqs, ks) if any(ks) else None
        t1 = time.perf_counter()
        last = torch.tensor([[s.tokens[-1]] for s in seqs], device=device)
        start = torch.tensor([[s.num_tokens - 1] for s in seqs], device=device)
        if draft is None:
            tokens, kk = last, 0
            draft_ids = torch.zeros(B, 0, dtype=torch.long, device=device)
            num_draft = torch.zeros(B, dtype=torch.long, device=device)
        else:
            draft_ids, num_draft = draft.tokens.to(device), draft.num_tokens.to(device)
            kk = draft_ids.shape[1]
            tokens = torch.cat([last, draft_ids.clamp(min=0)], dim=1)  # (B, 1+K)
        positions = start + torch.arange(kk + 1, device=device)  # (B, 1+K)
        rows = torch.tensor([s.row for s in seqs], device=device)
        if rows.tolist() == list(range(B)):
            rows = None
        logits = self.runner.forward(tokens, positions, rows).logits  # (B, 1+K, V)
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            out_ids, n_acc = verify_greedy(draft_ids, logits, num_draft)
        else:
            st = SamplingTensors.from_params(params, device)
            target_probs = logits_to_probs(logits, st)
            draft_probs = draft.probs if draft is not None else None
            out_ids, n_acc = verify_sampled(draft_ids, draft_probs, target_probs, num_draft,
                                            RowGenerators.from_generators([s.generator for s in seqs], device))
        t2 = time.perf_counter()
        out_ids, n_acc = out_ids.tolist(), n_acc.tolist()
        for i, s in enumerate(seqs):
            s.num_steps += 1
            s.draft_seconds += t1 - t0
            s.verify_seconds += t2 - t1
            nd = int(num_draft[i])
            s.num_draft += nd
            s.num_accepted += n_acc[i]
            for j in range(nd):
                if j >= len(s.drafted_at):
                    s.drafted_at.append(0)
                    s.accepted_at.append(0)
                s.drafted_at[j] += 1
                s.accepted_at[j] += int(j < n_acc[i])
            s.append(out_ids[i][:n_acc[i] + 1])
        if self.proposer is not None:
            self.proposer.on_accept(seqs, n_acc)
            if draft is None:
                self.k_policy.observe_plain(B, t2 - t0)
            for i, s in enumerate(seqs):
                self.k_policy.update(s, int(num_draft[i]), n_acc[i], t2 - t0, B)
                if s.finished:
                    self._release(s)
        self.running = [s for s in seqs if not s.finished]
        t3 = time.perf_counter()
        self.times.draft += t1 - t0
        self.times.verify += t2 - t1
        self.times.other += t3 - t2
        return seqs


def sequence_metrics(seq: Sequence) -> RequestMetrics:
    """Per-request metrics from a finished (or running) sequence."""
    now = time.perf_counter()
    t_first = seq.t_first or now
    t_end = seq.t_end or now
    n = len(seq.output_ids)
    prefill = t_first - seq.t_start
    decode = max(t_end - t_first, 0.0)
    total = prefill + decode
    emitted = (seq.num_accepted + seq.num_steps) / seq.num_steps if seq.num_steps else 0.0  # bonus counted
    return RequestMetrics(
        num_prompt_tokens=len(seq.prompt_ids), num_generated_tokens=n, prefill_seconds=prefill,
        decode_seconds=decode, tokens_per_second=n / total if total > 0 else 0.0,
        decode_tokens_per_second=(n - 1) / decode if decode > 0 and n > 1 else 0.0,
        num_steps=seq.num_steps, num_draft_tokens=seq.num_draft, num_accepted_tokens=seq.num_accepted,
        acceptance_rate=seq.num_accepted / seq.num_draft if seq.num_draft else 0.0,
        mean_accepted_length=float(emitted),
        acceptance_by_position=[a / d if d else 0.0 for a, d in zip(seq.accepted_at, seq.drafted_at)],
        num_drafted_by_position=list(seq.drafted_at), num_accepted_by_position=list(seq.accepted_at),
        draft_seconds=seq.draft_seconds, verify_seconds=seq.verify_seconds,
        other_seconds=max(total - seq.draft_seconds - seq.verify_seconds, 0.0),
    )
