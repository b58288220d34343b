"""Tokens per step of model-free drafters (ngram, suffix) replayed over a bench run's greedy outputs.

    python scripts/replay_drafters.py --results results/r2-code-edit.json \
        --prompts specdec/tools/bench/data/code_edit.jsonl --model qwen2.5-coder-1.5b \
        --config '{"method": "ngram"}' --config '{"method": "suffix", "suffix_factor": 4}' --k 8

The greedy outputs are the run's plain records (or any config's: greedy speculative outputs equal
plain ones); the prompts are re-tokenized with the model's tokenizer (no weights are loaded). Each
configuration replays every prompt in the run's order through one proposer (specdec.tools.bench.replay).
"""
from __future__ import annotations

import argparse
import json
import sys

from specdec.errors import SpecdecError
from specdec.models.hub import resolve_model
from specdec.models.tokenizer import Tokenizer
from specdec.proposers.registry import parse_config
from specdec.tools.bench.prompts import load_prompts
from specdec.tools.bench.replay import ReplayStats, replay
from specdec.tools.bench.speculative import prompt_ids


def requests(results: str, prompts: list[str], tok: Tokenizer) -> list[tuple[list[int], list[int]]]:
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True, help="a specdec bench results JSON with plain greedy records")
    ap.add_argument("--prompts", nargs="+", required=True,
                    help="the prompt files that run used ('packaged': the packaged set)")
    ap.add_argument("--model", required=True, help="the model whose tokenizer the run used")
    ap.add_argument("--config", action="append", required=True, help="a speculative config (JSON), repeatable")
    ap.add_argument("--k", type=int, nargs="+", default=[8], help="node budgets")
    a = ap.parse_args(argv)
    try:
        reqs = requests(a.results, a.prompts, Tokenizer(resolve_model(a.model)))
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
