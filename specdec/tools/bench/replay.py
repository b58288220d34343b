"""Replay a model-free drafter (ngram, suffix) over recorded greedy outputs, without the target.

A drafter that reads only tokens proposes, at every step of greedy speculative decoding, a function of
the prompt and of the output so far, and the target keeps the longest drafted path that matches its
own greedy continuation plus one token of its own. With the greedy output recorded once (any lossless
run of ``specdec bench`` records it: every speculative output equals plain decoding's), the steps
each drafter configuration would take are counted exactly, in milliseconds instead of a model run:
tokens per step and tokens drafted per step, to tune a drafter's options before timing it.

The replay runs the engine's own step (``engine.step.speculative_step`` then ``accept``: the same
greedy chain and tree verification, the same proposer callbacks and the same counting,
``engine.accounting``) against a stand-in target, ``Recorded``, whose logits at each scored position
are one-hot on the recorded token that follows it. Requests are replayed in the recorded order
through one proposer, so a drafter that learns from finished requests (suffix's tree of past
outputs) learns as it would in the bench.

From the command line, over a bench run's recorded greedy outputs (formerly scripts/replay_drafters.py)::

    python -m specdec.tools.bench.replay --results results/r2-code-edit.json \
        --prompts specdec/tools/bench/data/code_edit.jsonl --model qwen2.5-coder-1.5b \
        --config '{"method": "ngram"}' --config '{"method": "suffix", "suffix_factor": 4}' --k 8

The greedy outputs are the run's plain records (or any config's: greedy speculative outputs equal
plain ones); the prompts are re-tokenized with the model's tokenizer (no weights are loaded). Each
configuration replays every prompt in the run's order through one proposer.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from specdec.config import SamplingParams
from specdec.engine.policies import FixedK
from specdec.engine.step import accept, speculative_step
from specdec.errors import SpecdecError
from specdec.models.llama import ForwardOutput
from specdec.proposers.base import Proposer
from specdec.runtime.sequence import Sequence


class _Silent:
    """A detokenizer that produces no text (the replay needs tokens only)."""

    def feed(self, ids) -> str:
        return ""

    def flush(self) -> str:
        return ""


class _NoCache:
    """The stand-in target keeps no keys or values: moving an accepted tree path is a no-op."""

    def copy_slots(self, rows, src, dst) -> None:
        pass


class Recorded:
    """A target whose greedy continuation is known: ``tokens`` (prompt + recorded output). Scored at
    position p, its logits are one-hot on ``tokens[p + 1]``, the token greedy decoding put after p
    (the verifier reads them only on drafted paths that match the recording, where that holds)."""

    device = torch.device("cpu")

    def __init__(self, tokens: list[int], vocab: int) -> None:
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.vocab = vocab
        self.cache = _NoCache()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows=None, hidden_layers=(),
                prompt_chunks=(), **_) -> ForwardOutput:
        nxt = self.tokens[(positions + 1).clamp(max=len(self.tokens) - 1)]  # (B, T)
        logits = torch.zeros(*nxt.shape, self.vocab, dtype=torch.float16)
        logits.scatter_(-1, nxt.unsqueeze(-1), 1.0)
        return ForwardOutput(logits=logits)


@dataclass
class ReplayStats:
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def drafted_per_step(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def replay(proposer: Proposer, requests: list[tuple[list[int], list[int]]], k: int) -> list[ReplayStats]:
    """Count the steps ``proposer`` at budget ``k`` takes on each (prompt ids, greedy output ids)."""
    vocab = 1 + max((max(p + o, default=0) for p, o in requests), default=0)
    policy = FixedK(k)
    out = []
    for n, (prompt, output) in enumerate(requests):
        seq = Sequence(request_id=f"replay-{n}", prompt=None, prompt_ids=list(prompt),
                       params=SamplingParams(temperature=0.0, max_tokens=max(1, len(output)), ignore_eos=True),
                       detokenizer=_Silent(), eos_ids=frozenset(), max_len=len(prompt) + len(output) + k + 1,
                       seed=0, row=0)
        target = Recorded(list(prompt) + list(output), vocab)
        proposer.add(seq)
        while output and not seq.finished:
            failed = accept([seq], speculative_step(target, proposer, [seq], [k]), proposer, policy)
            if failed:
                raise SpecdecError(f"replaying request {n}: {failed[0][1]}")
        if seq.output_ids != list(output)[:len(seq.output_ids)]:
            raise SpecdecError(f"replaying request {n}: the stand-in target left its recording")
        if not seq.finished:
            seq.finish("length", None)
        proposer.remove(seq)
        out.append(ReplayStats(len(seq.output_ids), seq.num_steps, seq.num_draft, seq.num_accepted))
    return out


def recorded_requests(results: str, prompts: list[str], tok) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy output ids) of every question of a bench results file's plain specdec records,
    in the run's order; the prompts re-tokenized by ``tok`` (a ``Tokenizer``) as the bench did."""
    from specdec.tools.bench.prompts import load_prompts
    from specdec.tools.bench.speculative import prompt_ids

    with open(results, encoding="utf-8") as f:
        records = json.load(f)["records"]
    by_id = {p.question_id: p for p in load_prompts(prompts)}
    greedy = {}
    for r in records:
        if r["method"] == "plain" and r.get("engine", "specdec") == "specdec":
            greedy.setdefault(r["question_id"], r["token_ids"])
    if not greedy:
        raise SpecdecError(f"{results} has no plain specdec records to replay")
    out = []
    for qid, ids in greedy.items():  # the run's order
        p = by_id.get(qid)
        if p is None:
            raise SpecdecError(f"question {qid} of {results} is not in {', '.join(prompts)}")
        out.append((prompt_ids(tok, p, [{"role": "user", "content": p.turns[0]}] if p.is_chat else None), ids))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Tokens per step of model-free drafters (ngram, suffix) replayed "
                                             "over a bench run's greedy outputs.")
    ap.add_argument("--results", required=True, help="a specdec bench results JSON with plain greedy records")
    ap.add_argument("--prompts", nargs="+", required=True,
                    help="the prompt files that run used ('packaged': the packaged set)")
    ap.add_argument("--model", required=True, help="the model whose tokenizer the run used")
    ap.add_argument("--config", action="append", required=True, help="a speculative config (JSON), repeatable")
    ap.add_argument("--k", type=int, nargs="+", default=[8], help="node budgets")
    a = ap.parse_args(argv)
    from specdec.formats.hub import resolve_model
    from specdec.formats.tokenizer import Tokenizer
    from specdec.proposers.registry import parse_config

    try:
        reqs = recorded_requests(a.results, a.prompts, Tokenizer(resolve_model(a.model)))
        print(f"{len(reqs)} requests, {sum(len(o) for _, o in reqs)} output tokens\n")
        print("| config | K | tokens per step | drafted per step | acceptance |")
        print("|---|---|---|---|---|")
        for text in a.config:
            try:
                opts = parse_config(json.loads(text))
            except json.JSONDecodeError as e:
                raise SpecdecError(f"--config {text!r} is not JSON: {e}") from e
            for k in a.k:
                stats = replay(opts.build(None), reqs, k)
                tot = ReplayStats(sum(s.tokens for s in stats), sum(s.steps for s in stats),
                                  sum(s.drafted for s in stats), sum(s.accepted for s in stats))
                print(f"| {text} | {k} | {tot.tokens_per_step:.2f} | {tot.drafted_per_step:.2f} | "
                      f"{100 * tot.acceptance:.1f}% |")
    except (SpecdecError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
