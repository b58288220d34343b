"""`specdec train eagle | medusa`'s flags (argparse only: the training modules load when it runs)."""
from __future__ import annotations

import argparse


def add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a drafter for a model (eagle: an EAGLE-3-style head; medusa: Medusa heads)")
    kinds = t.add_subparsers(dest="kind", required=True)
    e = kinds.add_parser("eagle", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="train an EAGLE-3-style head: data, features, training, export, evaluation "
                                       "(rerun the same command to resume)")
    common_flags(e, seq_len=512, lr=3e-4)
    e.add_argument("--draft-vocab-size", type=int, default=32768, help="the head's vocabulary (most frequent tokens)")
    e.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the target's)")
    e.add_argument("--aux-layers", type=int, nargs=3, default=None,
                   help="speculators' layer ids read (default: 2, L/2, L-3)")
    e.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll")
    e.set_defaults(func=cmd_train, module="specdec.train.pipeline")
    m = kinds.add_parser("medusa", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         help="train Medusa heads on the target's last hidden state: data, features, training, "
                              "per-head accuracies (the candidate tree), export, evaluation (rerun to resume)")
    common_flags(m, seq_len=256, lr=1e-3)
    m.add_argument("--num-heads", type=int, default=4, help="heads: tokens guessed beyond the target's own next one")
    m.add_argument("--topk", type=int, default=10, help="ranks whose accuracy is measured per head (tree width)")
    m.add_argument("--train-vocab-size", type=int, default=32768,
                   help="the loss's vocabulary: the corpus's most frequent tokens, the target's law renormalised "
                        "over them (cost follows it; drafting always uses the full LM head); 0: the full vocabulary")
    m.add_argument("--eval-nodes", type=int, default=8, help="tree nodes per step in the acceptance evaluation")
    m.set_defaults(func=cmd_train, module="specdec.train.medusa")


def common_flags(e: argparse.ArgumentParser, seq_len: int, lr: float) -> None:
    """The flags every head kind takes: target, data and split, training schedule, evaluation."""
    e.add_argument("--model", required=True, help="the target: an embedded name or a Hugging Face directory")
    e.add_argument("--output", required=True, help="working directory; the head lands in OUTPUT/head")
    e.add_argument("--data", nargs="+", default=["sharegpt", "stdlib"],
                   help="sources: sharegpt, stdlib, FILE.jsonl, a file or directory; NAME:N caps at N records")
    e.add_argument("--max-tokens", type=int, default=1_000_000, help="training tokens in all (split over sources)")
    e.add_argument("--max-seq-len", type=int, default=2048, help="tokens kept per record")
    e.add_argument("--heldout-per-mille", type=int, default=5, help="records kept out for evaluation, per 1000")
    e.add_argument("--quantization", choices=("int4", "int8"), default=None, help="extract from a quantized target (default: bf16)")
    e.add_argument("--regenerate", action="store_true",
                   help="train on the target's own replies: each conversation becomes its first user turn and the "
                        "target's greedy reply (cached in OUTPUT/regenerated.jsonl, resumable)")
    e.add_argument("--regen-max-tokens", type=int, default=256, help="tokens per regenerated reply at most")
    e.add_argument("--regen-batch", type=int, default=8, help="conversations regenerated together")
    e.add_argument("--epochs", type=float, default=2.0, help="passes over the extracted features")
    e.add_argument("--seq-len", type=int, default=seq_len, help="training window")
    e.add_argument("--batch-tokens", type=int, default=2048, help="tokens per optimizer step")
    e.add_argument("--lr", type=float, default=lr, help="AdamW peak learning rate (warm-up, then cosine decay)")
    e.add_argument("--checkpoint-minutes", type=float, default=5.0, help="save a resumable checkpoint this often")
    e.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts measured at each checkpoint (0: none)")
    e.add_argument("--final-eval-prompts", type=int, default=32, help="held-out prompts of the final evaluation")
    e.add_argument("--eval-tokens", type=int, default=64, help="tokens generated per evaluation prompt")
    e.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    e.add_argument("--seed", type=int, default=0, help="seed of the data split, initialization and shuffling")


def cmd_train(a: argparse.Namespace) -> int:
    import importlib  # noqa: PLC0415
    return importlib.import_module(a.module).run(a)  # heavy: the training modules load only when training


def add_distill_parser(sub) -> None:
    d = sub.add_parser("distill", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="fine-tune a draft model on the target's own outputs for your prompts (rerun to resume)")
    d.add_argument("--target", required=True, help="the target: an embedded name or a Hugging Face directory")
    d.add_argument("--draft", required=True, help="the draft to fine-tune (same tokenizer as the target)")
    d.add_argument("--output", required=True, help="working directory; the fine-tuned draft lands in OUTPUT/draft")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", nargs="+", help="benchmark JSONL (Spec-Bench 'turns' or 'prompt' records), chat "
                                                  "JSONL ('messages'), 'sharegpt[:N]' or 'packaged'")
    src.add_argument("--traffic", help="a directory recorded by `specdec serve --record-traffic DIR`")
    d.add_argument("--categories", nargs="+", default=None, help="only these categories of benchmark files")
    d.add_argument("--limit", type=int, default=None, help="at most this many prompts in all")
    d.add_argument("--eval-others", nargs="*", default=["packaged"],
                   help="prompts of other domains whose acceptance must not fall (none: skip)")
    d.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per set")
    d.add_argument("--heldout-per-mille", type=int, default=100, help="share of the prompts held out, per 1000")
    d.add_argument("--max-tokens", type=int, default=256, help="target output tokens per prompt")
    d.add_argument("--max-prompt-tokens", type=int, default=1024, help="prompt tokens kept (the last ones)")
    d.add_argument("--temperature", type=float, default=0.0, help="the target's sampling temperature for training "
                                                                  "outputs (evaluation is greedy)")
    d.add_argument("--gen-batch", type=int, default=8, help="prompts generated at once")
    d.add_argument("--target-quantization", choices=("int4", "int8"), default=None,
                   help="generate with a quantized target (its outputs are what the draft learns)")
    d.add_argument("--mode", choices=("lora", "full"), default="lora", help="LoRA adapters (merged) or every weight")
    d.add_argument("--lora-rank", type=int, default=32, help="LoRA rank")
    d.add_argument("--epochs", type=float, default=2.0, help="passes over the target's outputs")
    d.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 2e-4 lora, 2e-5 full)")
    d.add_argument("--batch-tokens", type=int, default=2048, help="target tokens per optimizer step")
    d.add_argument("--k", type=int, default=5, help="draft length of the acceptance evaluation")
    d.add_argument("--draft-quantization", choices=("int4", "int8"), default=None,
                   help="evaluate the draft quantized, as it will be deployed")
    d.add_argument("--speed-prompts", type=int, default=8,
                   help="prompts per set (held out, other domains) of the final speed measurement: plain, the "
                        "original and the fine-tuned draft side by side (0: skip; run it on a quiet machine)")
    d.add_argument("--checkpoint-minutes", type=float, default=5.0, help="save a resumable checkpoint this often")
    d.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    d.add_argument("--seed", type=int, default=0, help="seed of the data order")
    d.set_defaults(func=cmd_distill)


def cmd_distill(a: argparse.Namespace) -> int:
    from specdec.train.distill import run  # noqa: PLC0415 (heavy: loads only when distilling)
    for name in ("limit", "eval_prompts", "max_tokens", "max_prompt_tokens", "gen_batch", "lora_rank", "k",
                 "batch_tokens", "threads"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise SystemExit(f"specdec distill: error: --{name.replace('_', '-')} must be >= 1, got {v}")
    if a.speed_prompts < 0:
        raise SystemExit(f"specdec distill: error: --speed-prompts must be >= 0, got {a.speed_prompts}")
    if a.epochs <= 0 or a.temperature < 0 or a.checkpoint_minutes <= 0 or not 0 <= a.heldout_per_mille <= 1000:
        raise SystemExit("specdec distill: error: --epochs and --checkpoint-minutes must be > 0, --temperature >= 0, "
                         "--heldout-per-mille in 0..1000")
    return run(a)
