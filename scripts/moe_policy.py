"""Speculation on a mixture-of-experts target, where the drafts fail and where they pass: does the
cost-aware draft length (engine/budget.py ``CostAwareK``, the engine's policy for every MoE target) keep
it from running slower than plain decoding, and let it speculate where that pays? One process per
drafter, rounds interleaved so a drift of the host's speed moves all ways alike.

    python scripts/moe_policy.py --rounds 3 --tokens 48 --drafters fail,int4-self,ngram

The target: an OLMoE-shaped model of about a billion parameters with random weights (16 layers, hidden
1024, 64 experts of 320, 8 per token), built by transformers' own OLMoE class and saved once under
``--cache``. The drafters: ``fail``, a random one-layer Llama of the same tokenizer, whose drafts the
target rejects; ``int4-self``, the target's own weights quantized to int4 (the draft-model method with
``quantization: int4``), whose drafts the bf16 target mostly accepts; ``ngram``, prompt lookup (a
random model's greedy text falls into loops, which lookup then drafts for free). Three ways, each on the same prompts,
greedy: plain decoding; speculation with the cost-aware policy (the default); speculation with a fixed K
(the policy switched off: what other engines do). Prints tokens per second of each, the ratios to plain,
the draft tokens proposed and accepted, and whether every way's tokens equal plain decoding's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SHAPE = dict(hidden_size=1024, intermediate_size=320, moe_intermediate_size=320, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
             norm_topk_prob=False, max_position_embeddings=4096)


def build(cache: Path) -> tuple[Path, Path]:
    from conftest import make_tokenizer  # the suites' small BPE tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    target, draft = cache / "olmoe-1b", cache / "draft"
    for path, model_type, kw in ((target, "olmoe", SHAPE),
                                 (draft, "llama", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                                       num_attention_heads=4, num_key_value_heads=2))):
        if (path / "config.json").is_file():
            continue
        path.mkdir(parents=True, exist_ok=True)
        vocab = make_tokenizer(path)
        cfg = AutoConfig.for_model(model_type, vocab_size=vocab, pad_token_id=None, bos_token_id=None,
                                   eos_token_id=None, **kw)
        torch.manual_seed(0 if model_type == "olmoe" else 3)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(path)
        print(f"built {path} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters)", flush=True)
    return target, draft


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/specdec/bench/moe_policy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--drafters", default="fail", help="comma-separated: fail, int4-self, ngram")
    a = ap.parse_args()
    target, draft = build(a.cache)
    for d in a.drafters.split(","):
        if d == "fail":
            spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": a.k}
        elif d == "int4-self":
            spec = {"method": "draft_model", "model": str(target), "quantization": "int4", "num_speculative_tokens": a.k}
        elif d == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": a.k}
        else:
            ap.error(f"unknown drafter {d!r}: fail, int4-self or ngram")
        print(f"\n## drafter: {d}", flush=True)
        run(target, spec, a)
    return 0


def run(target: Path, spec: dict, a: argparse.Namespace) -> None:
    """Plain, cost-aware and fixed-K decoding with one drafter, interleaved over the rounds."""
    from specdec import LLM, SamplingParams

    prompts = ["The history of the city begins", "def parse(text):", "Once upon a time", "In this paper we"]
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    llm = LLM(model=str(target), dtype="bfloat16", progress=False, speculative_config=spec)
    fixed = LLM(model=str(target), dtype="bfloat16", progress=False, speculative_config=spec)
    fixed_policy = fixed.engine  # the same engine with the cost-aware wrapper taken off

    def engine_without_cost(*args, **kw):
        core = fixed_policy(*args, **kw)
        core.policy = getattr(core.policy, "base", core.policy)
        return core

    fixed.engine = engine_without_cost
    ways = {"plain": (llm, 0), "cost-aware K (default)": (llm, None), f"fixed K={a.k}": (fixed, None)}
    rates: dict[str, list[float]] = {w: [] for w in ways}
    drafted = {w: [0, 0] for w in ways}
    tokens: dict[str, list] = {w: [] for w in ways}
    for w, (m, k) in ways.items():  # warm-up (and the cost measurement of the cost-aware policy)
        m.generate(prompts[:1], params.replace(max_tokens=4), num_speculative_tokens=k)
    for r in range(a.rounds):
        for w, (m, k) in ways.items():
            n, t = 0, 0.0
            for p in prompts:  # one request at a time: batch 1
                t0 = time.perf_counter()
                out = m.generate(p, params, num_speculative_tokens=k)[0]
                t += time.perf_counter() - t0
                n += len(out.outputs[0].token_ids)
                drafted[w][0] += out.metrics.num_draft_tokens
                drafted[w][1] += out.metrics.num_accepted_tokens
                if r == 0:
                    tokens[w].append(list(out.outputs[0].token_ids))
            rates[w].append(n / t)
            print(f"round {r + 1} {w}: {n / t:.2f} tok/s", flush=True)
    base = statistics.median(rates["plain"])
    print(f"\n| way | tok/s (median of {a.rounds}) | vs plain | draft tokens | accepted | tokens equal plain |")
    print("|---|---|---|---|---|---|")
    for w in ways:
        med = statistics.median(rates[w])
        print(f"| {w} | {med:.2f} | {med / base:.3f} | {drafted[w][0]} | {drafted[w][1]} | "
              f"{'yes' if tokens[w] == tokens['plain'] else 'NO'} |")
    print("per round, vs plain: " + "; ".join(
        f"{w}: " + ", ".join(f"{x / b:.3f}" for x, b in zip(rates[w], rates["plain"])) for w in ways if w != "plain"))


if __name__ == "__main__":
    raise SystemExit(main())
