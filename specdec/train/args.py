"""`specdec train eagle`'s flags (argparse only: the training modules load when it runs)."""
from __future__ import annotations

import argparse


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a drafter for a model (eagle: an EAGLE-3-style head)")
    kinds = t.add_subparsers(dest="kind", required=True)
    e = kinds.add_parser("eagle", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="train an EAGLE-3-style head: data, features, training, export, evaluation "
                                       "(rerun the same command to resume)")
    e.add_argument("--model", required=True, help="the target: an embedded name or a Hugging Face directory")
    e.add_argument("--output", required=True, help="working directory; the head lands in OUTPUT/head")
    e.add_argument("--data", nargs="+", default=["sharegpt", "stdlib"],
                   help="sources: sharegpt, stdlib, FILE.jsonl, a file or directory; NAME:N caps at N records")
    e.add_argument("--max-tokens", type=int, default=1_000_000, help="training tokens in all (split over sources)")
    e.add_argument("--max-seq-len", type=int, default=2048, help="tokens kept per record")
    e.add_argument("--heldout-per-mille", type=int, default=5, help="records kept out for evaluation, per 1000")
    e.add_argument("--quantization", choices=("int4", "int8"), default=None, help="extract from a quantized target (default: bf16)")
    e.add_argument("--draft-vocab-size", type=int, default=32768, help="the head's vocabulary (most frequent tokens)")
    e.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the target's)")
    e.add_argument("--aux-layers", type=int, nargs=3, default=None,
                   help="speculators' layer ids read (default: 2, L/2, L-3)")
    e.add_argument("--epochs", type=float, default=2.0, help="passes over the extracted features")
    e.add_argument("--seq-len", type=int, default=512, help="training window")
    e.add_argument("--batch-tokens", type=int, default=2048, help="tokens per optimizer step")
    e.add_argument("--lr", type=float, default=3e-4, help="AdamW peak learning rate (warm-up, then cosine decay)")
    e.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll")
    e.add_argument("--checkpoint-minutes", type=float, default=5.0, help="save a resumable checkpoint this often")
    e.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts measured at each checkpoint (0: none)")
    e.add_argument("--final-eval-prompts", type=int, default=32, help="held-out prompts of the final evaluation")
    e.add_argument("--eval-tokens", type=int, default=64, help="tokens generated per evaluation prompt")
    e.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    e.add_argument("--seed", type=int, default=0, help="seed of the data split, initialization and shuffling")
    e.set_defaults(func=cmd_train)


def cmd_train(a: argparse.Namespace) -> int:
    from specdec.train.pipeline import run  # noqa: PLC0415 (heavy: loads only when training)
    return run(a)
