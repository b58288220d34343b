"""`specdec bench`'s command line; the benchmark itself (speculative.py) loads only when it runs."""
from __future__ import annotations

import argparse

from specdec.args import add_model_args, add_spec_args
from specdec.tools.bench.peer_llamacpp import BUILD_COMMAND, DEFAULT_BIN_DIR  # stdlib only


def _run(a: argparse.Namespace) -> int:
    if a.long:
        from specdec.tools.bench.long_context import cmd_long  # noqa: PLC0415
        return cmd_long(a)
    from specdec.tools.bench.speculative import cmd_bench  # noqa: PLC0415
    return cmd_bench(a)


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Register ``specdec bench`` on the CLI's subparsers."""
    b = sub.add_parser("bench", conflict_handler="resolve", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="plain vs speculative decoding on a prompt set (Spec-Bench style), tables and plots",
                       description="Speculative vs plain decoding, side by side in one run, per category, method and "
                       "draft length K.\n\nPrompt file: JSONL, one record per line, "
                       "Spec-Bench's {\"question_id\", \"category\", \"turns\": [...]} (chat-templated; the "
                       "first turn unless --all-turns) or {\"prompt\": \"...\", \"category\": \"...\"} "
                       "(raw completion). Default: the packaged set (code, chat, summarization, structured output)."
                       "\n\n--long: long prompts instead (code files, RAG, summarization at --lengths tokens): decode "
                       "speedup and time to first token against prompt length, e.g. specdec bench --long --model M "
                       "--speculative-method ngram --lengths 2048,8192 --plots results/long.")
    add_model_args(b)
    add_spec_args(b, sweep=True)
    b.add_argument("--method-option", action="append", default=[], metavar="METHOD.OPTION=VALUE",
                   help="one method's own option in a sweep, over the shared flags (e.g. eagle.model=DIR beside "
                        "--speculative-model DRAFT for draft_model; VALUE as JSON, else a string); repeatable; default: none")
    b.add_argument("--prompts", nargs="+", default=None, metavar="FILE",
                   help="JSONL prompt file(s), concatenated; 'packaged' names the packaged set (the default)")
    b.add_argument("--limit", type=int, default=None, help="at most N prompts per category (default: all)")
    b.add_argument("--categories", default=None, help="only these categories, comma-separated (e.g. qa,rag; default: all)")
    b.add_argument("--all-turns", action="store_true", help="run every turn of multi-turn records")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per turn (default 128)")
    b.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-tokens tokens (llama.cpp's peer always does)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; outputs checked)")
    b.add_argument("--seed", type=int, default=0, help="random seed of sampled runs (default 0)")
    b.add_argument("--output", default=None, help="results JSON (default results/bench.json); with --long a JSONL "
                   "of measurements that a rerun resumes (default results/bench_long.jsonl)")
    b.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots into DIR (default: no plots)")
    g = b.add_argument_group("long prompts (--long)")
    g.add_argument("--long", action="store_true",
                   help="measure long prompts instead of a prompt set: per prompt plain greedy decoding first (its "
                        "prefill is the time to first token), then each drafter, outputs checked equal; tables of "
                        "acceptance and decode / end-to-end speedup by length; with --plots, "
                        "decode_speedup_by_length.png and ttft_by_length.png; --output: a JSONL that a rerun "
                        "resumes (docs/benchmarking.md)")
    g.add_argument("--lengths", default=None, metavar="N,N",
                   help="with --long: prompt lengths in tokens, chat template included, comma-separated, each at "
                        "least 256 (default 2048,8192; 16384 and 32768 work where the model's context holds them: "
                        "on a 2-core CPU an int4 1.5B model's 16k prefill takes about 4 minutes per prompt, 32k's "
                        "several times that)")
    g.add_argument("--styles", default=None, metavar="S,S",
                   help="with --long: prompt styles, comma-separated, from code (source files, then a question "
                        "about a function in them), rag (numbered passages, then a question about one), "
                        "summarization (default: all three)")
    b.add_argument("--peer", choices=["hf", "llamacpp"], default=None,
                   help="hf: also run transformers' own plain and assisted generation on the same prompts; "
                        "llamacpp: llama.cpp's plain and speculative binaries on the same GGUF files (greedy); default: none")
    b.add_argument("--llamacpp-bin", default=str(DEFAULT_BIN_DIR), metavar="DIR",
                   help=f"llama.cpp binaries for --peer llamacpp (default {DEFAULT_BIN_DIR}; build them with "
                        f"{BUILD_COMMAND})")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=_run)
    return b
