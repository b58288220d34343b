"""`specdec generate | pull | demo | cache | methods | bench | serve`: the command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.args import (add_model_args, add_sampling_args, add_spec_args, add_structured_args, deployment_config,
                          sampling_params, speculative_config)
from specdec.cache import add_cache_parser
from specdec.demo import add_demo_parser
from specdec.errors import SpecdecError
from specdec.server import add_serve_parser
from specdec.tools.bench.args import add_bench_parser
from specdec.tools.tune.cli import add_tune_parser
from specdec.train.args import add_distill_parser, add_train_parser


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
    cfg = deployment_config(a)  # flags given override it: LLM takes an argument over the config's value
    llm = LLM(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len, config=cfg,
              speculative_config=speculative_config(a), quantization=a.quantization, progress=not a.json,
              kv_cache_memory=a.kv_cache_memory)
    run = llm.chat if a.chat else llm.generate
    arg = [{"role": "user", "content": prompt}] if a.chat else prompt
    if a.json:
        out = run(arg, params)[0]
        print(json.dumps({"text": out.outputs[0].text, "token_ids": out.outputs[0].token_ids,
                          "finish_reason": out.outputs[0].finish_reason,
                          "metrics": out.metrics.to_dict()}
                         | ({} if params.logprobs is None else {"logprobs": [
                             {"token_id": t.token_id, "logprob": t.logprob, "top": t.top}
                             for t in out.outputs[0].logprobs]}), ensure_ascii=False))
        return 0
    printed = [0]
    ends_line = [True]  # whether what was written so far ends with a newline

    def stream(seqs) -> None:
        text = seqs[0].text
        if len(text) > printed[0]:
            sys.stdout.write(text[printed[0]:])
            sys.stdout.flush()
            ends_line[0] = text.endswith("\n")
        printed[0] = max(printed[0], len(text))

    out = run(arg, params, on_step=stream)[0]
    # a stop string found late may shorten the text: the stream never shows it past the stop point
    if not ends_line[0]:
        sys.stdout.write("\n")  # end the output with a newline, as shell tools expect
    sys.stdout.flush()
    m = out.metrics
    spec = (f", acceptance {m.acceptance_rate:.0%}, {m.mean_accepted_length:.2f} tokens/step"
            if m.num_draft_tokens else "")
    print(f"[{m.num_generated_tokens} tokens, {m.tokens_per_second:.2f} tok/s, "
          f"prefill {m.prefill_seconds:.2f}s, decode {m.decode_seconds:.2f}s{spec}, "
          f"finish: {out.outputs[0].finish_reason}]", file=sys.stderr)
    if params.structured_output is not None and out.outputs[0].finish_reason == "length":
        print("note: the output reached --max-tokens before its structured output was complete (it does not "
              "match yet): raise --max-tokens", file=sys.stderr)
    return 0


def cmd_pull(a: argparse.Namespace) -> int:
    from specdec.formats.hub import pull  # noqa: PLC0415
    for name in a.names:
        print(f"{name}: {pull(name, progress=True)}")
    return 0


def cmd_methods(a: argparse.Namespace) -> int:
    """Every speculation method's options, from their schemas (docs/methods.md is this output, checked by a test)."""
    from specdec.proposers.options import markdown_table  # noqa: PLC0415
    from specdec.proposers.registry import schemas  # noqa: PLC0415
    for s in schemas():
        print(f"- `{s.method}`: {s.summary}")
    print()
    print(markdown_table(schemas()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streams to the terminal)")
    add_model_args(g, config=True)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (this or --prompt-file is required)")
    src.add_argument("--prompt-file", help="file holding the prompt text (this or --prompt is required)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    add_sampling_args(g)
    add_structured_args(g)
    add_spec_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids, metrics")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("methods", help="list the speculation methods and every option they take")
    m.set_defaults(func=cmd_methods)

    p = sub.add_parser("pull", help="download, check and convert embedded models ahead of time")
    p.add_argument("names", nargs="+", help="embedded model names, e.g. qwen2.5-coder-1.5b (required)")
    p.set_defaults(func=cmd_pull)

    add_demo_parser(sub)
    add_cache_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_train_parser(sub)
    add_distill_parser(sub)
    add_tune_parser(sub)
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
