"""What logprobs and penalties cost per token, with speculation on and off.

    python -m specdec.tools.bench.features --model qwen2.5-coder-1.5b --quantization int4 \
        --speculative-model qwen2.5-coder-0.5b --speculative-quantization int4 --num-speculative-tokens 5 \
        --max-tokens 128 --rounds 3 --output results/features.json

Each prompt runs under four settings (plain sampling parameters; + logprobs=5; + presence, frequency
and repetition penalties and a logit bias; + both), with speculation off and on, interleaved per
prompt (the order rotates) after a warm-up, greedy with ``ignore_eos`` so every run makes the same
number of tokens. Reported per setting: output tokens/s, milliseconds per token and the extra
milliseconds per token over the plain setting of the same mode; with speculation, the greedy
outputs with and without logprobs must match (logprobs change no token), which is checked.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec.args import add_model_args, add_spec_args, speculative_config
from specdec.config import SamplingParams
from specdec.tools.bench.prompts import load_prompts

SETTINGS = {
    "base": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                  "logit_bias": {0: -5.0}},
}
SETTINGS["both"] = SETTINGS["logprobs"] | SETTINGS["penalties"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.tools.bench.features", description=__doc__.split("\n")[0])
    add_model_args(ap)
    add_spec_args(ap)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=8, help="prompts from the packaged set (default 8)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the prompts (default 1)")
    ap.add_argument("--output", default=None, help="results JSON")
    a = ap.parse_args(argv)
    from specdec.llm import LLM  # noqa: PLC0415

    cfg = speculative_config(a)
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, quantization=a.quantization,
              speculative_config=cfg)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}]) if p.is_chat else p.prompt
               for p in load_prompts()][:a.limit]
    modes = {"plain": 0} | ({"speculative": llm.num_speculative_tokens} if cfg else {})
    runs = [(m, s) for m in modes for s in SETTINGS]
    base = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for k in modes.values():  # warm-up, every mode and setting
        for setting in SETTINGS.values():
            llm.generate(prompts[0], base.replace(max_tokens=8, **setting), num_speculative_tokens=k)
    secs = {r: 0.0 for r in runs}
    toks = {r: 0 for r in runs}
    mismatches = 0
    for rnd in range(a.rounds):
        for i, prompt in enumerate(prompts):
            order = runs[(i + rnd) % len(runs):] + runs[:(i + rnd) % len(runs)]
            outs = {}
            for mode, setting in order:
                t0 = time.perf_counter()
                out = llm.generate(prompt, base.replace(**SETTINGS[setting]), num_speculative_tokens=modes[mode])[0]
                secs[(mode, setting)] += time.perf_counter() - t0
                toks[(mode, setting)] += len(out.outputs[0].token_ids)
                outs[(mode, setting)] = out.outputs[0].token_ids
            for mode in modes:
                mismatches += outs[(mode, "base")] != outs[(mode, "logprobs")]
                mismatches += outs[(mode, "penalties")] != outs[(mode, "both")]
    rows = []
    print(f"{'mode':<12} {'setting':<10} {'tok/s':>8} {'ms/token':>9} {'+ms/token':>10}")
    for mode, setting in runs:
        ms = 1000 * secs[(mode, setting)] / max(toks[(mode, setting)], 1)
        extra = ms - 1000 * secs[(mode, "base")] / max(toks[(mode, "base")], 1)
        tps = toks[(mode, setting)] / secs[(mode, setting)]
        rows.append({"mode": mode, "setting": setting, "tokens_per_second": tps, "ms_per_token": ms,
                     "extra_ms_per_token": extra})
        print(f"{mode:<12} {setting:<10} {rows[-1]['tokens_per_second']:>8.2f} {ms:>9.2f} {extra:>+10.2f}")
    print(f"outputs changed by logprobs: {mismatches} (must be 0)")
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps({"argv": argv, "rows": rows, "mismatches": mismatches}, indent=1))
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
