"""Speculation on a mixture-of-experts target where the drafts fail: does the cost-aware draft length
(engine/budget.py ``CostAwareK``, the engine's policy for every MoE target) keep it from running slower
than plain decoding? One process, rounds interleaved so a drift of the host's speed moves all alike.

    python scripts/moe_policy.py --rounds 3 --tokens 48

The target: an OLMoE-shaped model of about a billion parameters with random weights (16 layers, hidden
1024, 64 experts of 320, 8 per token), built by transformers' own OLMoE class and saved once under
``--cache``. The draft: a random one-layer Llama of the same tokenizer, whose drafts the target
rejects. Three ways, each on the same prompts, greedy: plain decoding; speculation with the cost-aware
policy (the default); speculation with a fixed K (the policy switched off: what other engines do).
Prints tokens per second of each, the ratios to plain, the draft tokens proposed and the acceptance.
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
    a = ap.parse_args()
    from specdec import LLM, SamplingParams

    target, draft = build(a.cache)
    prompts = ["The history of the city begins", "def parse(text):", "Once upon a time", "In this paper we"]
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": a.k}
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
    plain_tokens = None
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
                if w == "plain" and r == 0:
                    plain_tokens = (plain_tokens or []) + [out.outputs[0].token_ids]
            rates[w].append(n / t)
            print(f"round {r + 1} {w}: {n / t:.2f} tok/s", flush=True)
    base = statistics.median(rates["plain"])
    print(f"\n| way | tok/s (median of {a.rounds}) | vs plain | draft tokens | accepted |")
    print("|---|---|---|---|---|")
    for w in ways:
        med = statistics.median(rates[w])
        print(f"| {w} | {med:.2f} | {med / base:.3f} | {drafted[w][0]} | {drafted[w][1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
