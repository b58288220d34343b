"""What quantization costs in accuracy: perplexity on held text and agreement with the unquantized model.

    python -m specdec.tools.bench.accuracy --model qwen2.5-coder-1.5b --kinds none,int8,int4,gguf \
        --output results/accuracy.json

Held text: Python standard-library sources (on every machine) and, with ``--prompts``, the Spec-Bench
questions; never seen by our quantizers. Scored in windows of ``--window`` tokens (teacher forcing).
Agreement: over the same windows, the fraction of positions whose top-1 token equals the reference's
(``none``: the model's own unquantized weights), and for a few prompts the length of the common
prefix of 64 greedy tokens. Not a test: the numbers describe the model files.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from pathlib import Path

import torch

HELD_MODULES = ("textwrap", "fractions", "heapq", "bisect", "shlex")
GREEDY_PROMPTS = ("Write a Python function that merges two sorted lists.",
                  "Explain the difference between a process and a thread.",
                  "Translate to German: The weather is nice today and we are going for a walk.")


def held_text(prompts: str | None, limit_chars: int = 120_000) -> str:
    parts = [inspect.getsource(__import__(m)) for m in HELD_MODULES]
    if prompts:
        for line in Path(prompts).read_text().splitlines():
            rec = json.loads(line)
            parts.extend(rec.get("turns", [rec.get("prompt", "")])[:1])
    return "\n\n".join(parts)[:limit_chars]


@torch.inference_mode()
def score(model, ids: list[int], window: int) -> tuple[float, list[torch.Tensor]]:
    """Mean negative log-likelihood per token over windows, and the top-1 predictions per window."""
    nll, count, tops = 0.0, 0, []
    for s in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[s:s + window + 1]])
        if chunk.shape[1] < 2:
            break
        inp, tgt = chunk[:, :-1], chunk[:, 1:]
        logits = model(inp, torch.arange(inp.shape[1])[None], model.new_cache(1, inp.shape[1])).logits.float()
        logp = torch.log_softmax(logits[0], -1)
        nll -= logp.gather(1, tgt[0, :, None]).sum().item()
        count += tgt.shape[1]
        tops.append(logits[0].argmax(-1))
    return nll / count, tops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.tools.bench.accuracy", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--kinds", default="none,int8,int4,gguf", help="none (reference), int8, int4, gguf")
    ap.add_argument("--tokens", type=int, default=4096, help="held tokens scored (default 4096)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", default=None, help="a Spec-Bench style JSONL whose questions join the held text")
    ap.add_argument("--output", default=None)
    a = ap.parse_args(argv)
    from specdec.errors import SpecdecError  # noqa: PLC0415
    from specdec.llm import LLM  # noqa: PLC0415
    from specdec.config import SamplingParams  # noqa: PLC0415
    from specdec.quant.qlinear import quantized_bytes  # noqa: PLC0415
    kinds = [k.strip() for k in a.kinds.split(",")]
    if kinds[0] != "none":
        kinds.insert(0, "none")
    rows, ref_tops, ref_greedy = [], None, None
    try:
        for kind in kinds:
            t0 = time.perf_counter()
            llm = LLM(a.model, quantization=None if kind == "none" else kind, progress=False)
            ids = llm.tokenizer.encode(held_text(a.prompts), add_special_tokens=False)[: a.tokens]
            nll, tops = score(llm.target.model, ids, a.window)
            params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
            greedy = [o.outputs[0].token_ids for o in llm.chat([[{"role": "user", "content": p}]
                                                               for p in GREEDY_PROMPTS], params)]
            if ref_tops is None:
                ref_tops, ref_greedy = tops, greedy
            agree = sum((x == y).sum().item() for x, y in zip(tops, ref_tops)) / sum(x.numel() for x in tops)
            prefix = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), len(g))
                      for g, r in zip(greedy, ref_greedy)]
            qb = quantized_bytes(llm.target.model)
            rows.append({"kind": kind, "perplexity": math.exp(nll), "nll": nll, "top1_agreement": agree,
                         "greedy_common_prefix": prefix, "quantized_weight_bytes": qb,
                         "tokens": len(ids), "seconds": time.perf_counter() - t0})
            print(f"{kind}: perplexity {math.exp(nll):.3f}, top-1 agreement {agree:.1%}, "
                  f"greedy common prefix {prefix} (of 64)", file=sys.stderr, flush=True)
            del llm
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = rows[0]["perplexity"]
    lines = ["| weights | quantized bytes | perplexity | vs unquantized | top-1 agreement | greedy common prefix (of 64) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        qb = f"{r['quantized_weight_bytes'] / 1e9:.2f} GB" if r["quantized_weight_bytes"] else "-"
        lines.append(f"| {r['kind']} | {qb} | {r['perplexity']:.3f} | {r['perplexity'] / base - 1:+.2%} | "
                     f"{r['top1_agreement']:.1%} | {', '.join(map(str, r['greedy_common_prefix']))} |")
    print("\n".join(lines))
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps({"model": a.model, "rows": rows, "markdown": "\n".join(lines),
                                              "command": "python -m specdec.tools.bench.accuracy " + " ".join(
                                                  argv if argv is not None else sys.argv[1:])}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
