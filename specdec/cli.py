"""`specdec generate | pull | demo`: the command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.bench.speculative import add_bench_parser
from specdec.errors import SpecdecError
from specdec.server import add_serve_parser

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="embedded model name, HF model directory or .gguf file")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--quantization", default=None, choices=("int4", "int8", "gguf"),
                   help="the target's weights: int4/int8 (from the bf16 weights) or gguf (the GGUF file's own "
                        "blocks); default: unquantized")


# cascade-self: the cascade whose drafter is the target's own weights quantized (a CLI shorthand)
METHODS = ("draft_model", "ngram", "layer_skip", "cascade", "cascade-self")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", default=None, choices=METHODS,
                   help="draft_model (default when --speculative-model is given), ngram, layer_skip, "
                        "cascade (n-gram drafts for --speculative-model, which drafts for the target) or "
                        "cascade-self (n-gram drafts for the target's own weights at "
                        "--speculative-quantization bits, default int4, which draft for the target)")
    g.add_argument("--speculative-model", default=None, help="draft model (name, HF directory or .gguf)")
    g.add_argument("--speculative-quantization", default=None, choices=("int4", "int8", "gguf"),
                   help="the draft's weights: int4, int8 or gguf (the GGUF file's own blocks); "
                        "for layer_skip, the bits of its self-draft (the target's own weights)")
    g.add_argument("--num-speculative-tokens", type=int, default=5, help="draft length K (default 5)")
    g.add_argument("--adaptive", action="store_true", help="adapt K to the acceptance seen so far")
    g.add_argument("--prompt-lookup-min", type=int, default=1, help="ngram: shortest n-gram to match")
    g.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest n-gram to match")
    g.add_argument("--skip-ratio", type=float, default=None,
                   help="layer_skip: share of layers skipped at first (default 0.45; 0 with --speculative-quantization)")
    g.add_argument("--search-steps", type=int, default=None,
                   help="layer_skip: steps of SWIFT's on-the-fly layer search per run (default 64; 0 with "
                        "--speculative-quantization)")
    g.add_argument("--draft-confidence-threshold", type=float, default=None,
                   help="draft_model, layer_skip: stop a draft after a token the draft gives less than this probability")
    g.add_argument("--draft-context", type=int, default=None,
                   help="draft_model: the draft reads only the last N prompt tokens (cheap prefill of long prompts)")


def speculative_config(a: argparse.Namespace) -> dict | None:
    """The ``speculative_config`` dict the CLI flags describe (None: plain decoding)."""
    method = a.speculative_method or ("draft_model" if a.speculative_model else None)
    if method is None:
        return None
    draft = {"model": a.speculative_model}
    if a.speculative_quantization is not None:
        draft["quantization"] = a.speculative_quantization
    lookup = {"prompt_lookup_min": a.prompt_lookup_min, "prompt_lookup_max": a.prompt_lookup_max}
    cfg: dict = {"method": method, "num_speculative_tokens": a.num_speculative_tokens, "adaptive": a.adaptive}
    if method == "draft_model":
        cfg |= draft
        if a.draft_confidence_threshold is not None:
            cfg["draft_confidence_threshold"] = a.draft_confidence_threshold
        if a.draft_context is not None:
            cfg["draft_context"] = a.draft_context
    elif method == "ngram":
        cfg |= lookup
    elif method == "layer_skip":
        for key in ("skip_ratio", "search_steps"):
            if getattr(a, key, None) is not None:
                cfg[key] = getattr(a, key)
        if a.speculative_quantization is not None:
            cfg["quantization"] = a.speculative_quantization  # a quantized self-draft
        if a.draft_confidence_threshold is not None:
            cfg["draft_confidence_threshold"] = a.draft_confidence_threshold
    elif method == "cascade-self":
        cfg |= {"method": "cascade", "stages": [
            {"method": "ngram", "num_speculative_tokens": 3, **lookup},
            {"method": "layer_skip", "quantization": a.speculative_quantization or "int4"}]}
    else:
        cfg["stages"] = [{"method": "ngram", "num_speculative_tokens": 3, **lookup},
                         {"method": "draft_model", **draft}]
    return cfg


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_params(a: argparse.Namespace):
    from specdec.config import SamplingParams  # noqa: PLC0415
    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          max_tokens=a.max_tokens, stop=tuple(a.stop), seed=a.seed, ignore_eos=a.ignore_eos)


def read_prompt(a: argparse.Namespace) -> str:
    if a.prompt_file is None:
        return a.prompt
    path = Path(a.prompt_file)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise SpecdecError(f"cannot read prompt file '{path}': {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise SpecdecError(f"prompt file '{path}' is not UTF-8 text") from e


def cmd_generate(a: argparse.Namespace) -> int:
    from specdec.llm import LLM  # noqa: PLC0415 (keeps `specdec --help` fast)
    params = sampling_params(a)
    prompt = read_prompt(a)
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
              speculative_config=speculative_config(a), quantization=a.quantization, progress=not a.json)
    run = llm.chat if a.chat else llm.generate
    arg = [{"role": "user", "content": prompt}] if a.chat else prompt
    if a.json:
        out = run(arg, params)[0]
        print(json.dumps({"text": out.outputs[0].text, "token_ids": out.outputs[0].token_ids,
                          "finish_reason": out.outputs[0].finish_reason,
                          "metrics": out.metrics.to_dict()}, ensure_ascii=False))
        return 0
    printed = [0]

    def stream(seqs) -> None:
        text = seqs[0].text
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    out = run(arg, params, on_step=stream)[0]
    # a stop string found late may shorten the text: the stream never shows it past the stop point
    m = out.metrics
    spec = (f", acceptance {m.acceptance_rate:.0%}, {m.mean_accepted_length:.2f} tokens/step"
            if m.num_draft_tokens else "")
    print(f"\n[{m.num_generated_tokens} tokens, {m.tokens_per_second:.2f} tok/s, "
          f"prefill {m.prefill_seconds:.2f}s, decode {m.decode_seconds:.2f}s{spec}, "
          f"finish: {out.outputs[0].finish_reason}]", file=sys.stderr)
    return 0


def cmd_pull(a: argparse.Namespace) -> int:
    from specdec.models.loading import pull  # noqa: PLC0415
    for name in a.names:
        print(f"{name}: {pull(name, progress=True)}")
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    """The main job: plain and speculative greedy decoding side by side on the default model pair."""
    import time  # noqa: PLC0415

    from specdec.config import SamplingParams  # noqa: PLC0415
    from specdec.llm import LLM  # noqa: PLC0415
    print(f"loading {a.model} with draft {a.draft} ({a.draft_quantization or 'bf16'}); the first run "
          "downloads and converts them (about a minute), later runs take seconds...", flush=True)
    quant = None if a.draft_quantization in (None, "none", "bf16") else a.draft_quantization
    llm = LLM(model=a.model, speculative_config={"method": "draft_model", "model": a.draft,
                                                 "num_speculative_tokens": a.k, "quantization": quant})
    msgs = [{"role": "user", "content": a.prompt}]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
    for k in (0, a.k):  # warm-up both paths
        llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4), num_speculative_tokens=k)
    runs = {}
    for name, k in (("plain", 0), ("speculative", a.k)):
        t0 = time.perf_counter()
        runs[name] = (llm.chat(msgs, params, num_speculative_tokens=k)[0], time.perf_counter() - t0)
    plain, spec = runs["plain"][0], runs["speculative"][0]
    print("-" * 72 + f"\n{spec.outputs[0].text}\n" + "-" * 72)
    for name, (out, secs) in runs.items():
        m = out.metrics
        extra = (f", acceptance {m.acceptance_rate:.0%}, {m.mean_accepted_length:.2f} tokens per target step"
                 if m.num_draft_tokens else "")
        print(f"{name:>12}: {m.num_generated_tokens} tokens in {secs:.2f}s = "
              f"{m.num_generated_tokens / secs:.2f} tok/s{extra}")
    same = plain.outputs[0].token_ids == spec.outputs[0].token_ids
    print(f"     speedup: {runs['plain'][1] / runs['speculative'][1]:.2f}x, "
          f"identical tokens: {'yes' if same else 'NO (a bug: please report it)'}")
    return 0 if same else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to the terminal)")
    add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    add_sampling_args(g)
    add_spec_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, metrics")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("pull", help="download, check and convert embedded models ahead of time")
    p.add_argument("names", nargs="+", help="embedded model names, e.g. qwen2.5-coder-1.5b")
    p.set_defaults(func=cmd_pull)

    d = sub.add_parser("demo", help="plain vs speculative decoding on the embedded default model pair")
    d.add_argument("--model", default=DEFAULT_TARGET)
    d.add_argument("--draft", default=DEFAULT_DRAFT)
    d.add_argument("--draft-quantization", default="int4", help="int4 (default), int8, gguf or none")
    d.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=5)
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("--max-tokens", type=int, default=128)
    d.set_defaults(func=cmd_demo)
    add_bench_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
