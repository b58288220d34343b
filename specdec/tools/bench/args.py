"""`specdec bench`'s command line; the benchmark itself (speculative.py) loads only when it runs."""
from __future__ import annotations

import argparse

from specdec.args import add_model_args, add_spec_args
from specdec.tools.bench.peer_llamacpp import BUILD_COMMAND, DEFAULT_BIN_DIR  # stdlib only


def _run(a: argparse.Namespace) -> int:
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
                       "(raw completion). Default: the packaged set (code, chat, summarization, structured output).")
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
    b.add_argument("--output", default="results/bench.json", help="results JSON (default results/bench.json)")
    b.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots into DIR (default: no plots)")
    b.add_argument("--peer", choices=["hf", "llamacpp"], default=None,
                   help="hf: also run transformers' own plain and assisted generation on the same prompts; "
                        "llamacpp: llama.cpp's plain and speculative binaries on the same GGUF files (greedy); default: none")
    b.add_argument("--llamacpp-bin", default=str(DEFAULT_BIN_DIR), metavar="DIR",
                   help=f"llama.cpp binaries for --peer llamacpp (default {DEFAULT_BIN_DIR}; build them with "
                        f"{BUILD_COMMAND})")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=_run)
    return b
