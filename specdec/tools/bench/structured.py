"""Structured output with speculation, measured: JSON-schema extraction prompts (records from prose,
tool calls), plain constrained decoding against speculative constrained decoding for each method,
with and without the grammar-forced draft, side by side in one run.

    python -m specdec.tools.bench.structured --model qwen2.5-coder-1.5b \\
        --draft-model qwen2.5-coder-0.5b --output results/structured.json

Each request runs alone (batch 1: latency), greedy, through the chat template; every output is
checked against its schema (jsonschema). Reported per configuration: generated tokens, tokens per
target step, tokens per second, speedup over plain constrained decoding, and the grammar engine's
own time per generated token (masks, forced tokens, consuming kept tokens), timed around those
calls in this process.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from specdec.errors import SpecdecError

PROMPT = ("Extract the information from the text below as a JSON object that follows this JSON schema:\n"
          "{schema}\n\nText: {text}\n\nAnswer with the JSON object only.")


def load_prompts(path: str | None) -> list[dict]:
    text = (Path(path).read_text() if path else
            resources.files("specdec.tools.bench").joinpath("data/extraction.jsonl").read_text())
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("text"), str) or not isinstance(r.get("schema"), dict):
            raise SpecdecError(f"prompt {i + 1}: each line must be {{\"text\": ..., \"schema\": {{...}}}}")
    return rows


METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},  # + the --draft-model
    "layer_skip": {"method": "layer_skip", "quantization": "int4", "num_speculative_tokens": 5},
    "cascade-self": {"method": "cascade-self", "num_speculative_tokens": 5},
}


def configs(args) -> list[tuple[str, dict | None, bool]]:
    """(name, speculative_config, constrained)."""
    out: list[tuple[str, dict | None, bool]] = [] if args.skip_unconstrained else [
        ("plain, unconstrained", None, False)]
    out += [("plain constrained", None, True),
            ("grammar-forced only", {"method": "grammar", "num_speculative_tokens": 8}, True)]
    for name in args.methods:
        cfg = dict(METHODS[name])
        if name == "draft_model":
            if not args.draft_model:
                raise SpecdecError("the draft_model method needs --draft-model")
            cfg |= {"model": args.draft_model, "num_speculative_tokens": args.draft_k}
            if args.draft_quantization:
                cfg["quantization"] = args.draft_quantization
        out.append((f"{name} + forced", cfg | {"grammar_draft": True}, True))
        out.append((f"{name}, model only", cfg | {"grammar_draft": False}, True))
    return out


class GrammarClock:
    """Seconds spent in the grammar engine's calls (masks, forced tokens, consuming kept tokens)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def installed(self):
        import specdec.engine.step as step
        from specdec.sampling import grammar

        patched = [(step, "block_masks"), (grammar.Matcher, "consume"), (grammar.Matcher, "forced"),
                   (grammar.DraftMasks, "apply"), (grammar.DraftMasks, "advance"), (grammar.DraftMasks, "release")]
        saved = [(obj, name, getattr(obj, name)) for obj, name in patched]
        for obj, name, fn in saved:
            setattr(obj, name, self._timed(fn))
        try:
            yield self
        finally:
            for obj, name, fn in saved:
                setattr(obj, name, fn)

    def _timed(self, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return wrapper


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="target: embedded model name or model directory")
    p.add_argument("--quantization", default=None, help="target quantization (int4, int8; default: none)")
    p.add_argument("--draft-model", default=None, help="draft model of the draft_model method (needed for it)")
    p.add_argument("--draft-quantization", default=None, help="draft model quantization")
    p.add_argument("--draft-k", type=int, default=4, help="draft length of the draft model (default 4)")
    p.add_argument("--methods", nargs="+", default=["ngram", "suffix", "draft_model"], choices=list(METHODS),
                   help="methods to compare (default: ngram suffix draft_model)")
    p.add_argument("--skip-unconstrained", action="store_true", help="leave out the unconstrained plain run")
    p.add_argument("--prompts", default=None, help="JSONL of {text, schema} (default: the 22 built in)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-tokens", type=int, default=256, help="per request (default 256)")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        return run(args)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    import jsonschema

    from specdec import LLM, SamplingParams
    from specdec.formats.progress import bar as progress_bar

    rows = load_prompts(args.prompts)[:args.limit]
    llm = LLM(model=args.model, quantization=args.quantization)
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT.format(
        schema=json.dumps(r["schema"]), text=r["text"])}]) for r in rows]
    results, base_tps = [], None
    for name, cfg, constrained in configs(args):
        llm.set_speculative_config(cfg)
        llm.generate(chats[0], SamplingParams(temperature=0.0, max_tokens=8))  # warm up (untimed)
        clock = GrammarClock()
        tokens = steps = accepted = drafted = valid = 0
        seconds = 0.0
        with clock.installed():
            for chat, r in progress_bar(list(zip(chats, rows)), desc=name, leave=False, file=sys.stderr):
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                        structured_output={"json": r["schema"]} if constrained else None)
                t0 = time.perf_counter()
                out = llm.generate(chat, params)[0]
                seconds += time.perf_counter() - t0
                m = out.metrics
                tokens += len(out.outputs[0].token_ids)
                steps += m.num_steps
                accepted += m.num_accepted_tokens
                drafted += m.num_draft_tokens
                try:
                    jsonschema.validate(json.loads(out.outputs[0].text), r["schema"])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
        tps = tokens / seconds
        if name == "plain constrained":
            base_tps = tps
        res = {"config": name, "speculative_config": cfg, "constrained": constrained, "requests": len(rows),
               "valid": valid, "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tps, 3),
               "tokens_per_step": round(tokens / max(steps, 1), 3),
               "acceptance": round(accepted / drafted, 3) if drafted else None,
               "grammar_ms_per_token": round(clock.seconds / max(tokens, 1) * 1e3, 3),
               "grammar_share": round(clock.seconds / seconds, 4)}
        res["speedup"] = round(tps / base_tps, 3) if base_tps else None
        results.append(res)
        print(f"{name:<26} valid {valid:>2}/{len(rows)}  {tokens:>5} tok  {res['tokens_per_step']:5.2f} tok/step  "
              f"{tps:6.2f} tok/s  x{res['speedup'] or 0:.2f}  grammar {res['grammar_ms_per_token']:.2f} ms/tok",
              flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"model": args.model, "quantization": args.quantization,
                                                 "draft_model": args.draft_model, "max_tokens": args.max_tokens,
                                                 "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
