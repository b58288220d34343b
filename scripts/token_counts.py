"""Make the token ranking shipped for a tokenizer (specdec/data/token_freq/<fingerprint>.npy).

A frequency-ranked draft head (``draft_vocab_size``) keeps the N most frequent target tokens. This
counts them on the data the project already uses: the Spec-Bench questions (every turn) and the
CPython standard library's sources (code, docstrings, comments; tests left out), and writes the top
``--top`` token ids, most frequent first, as uint32.

    python scripts/token_counts.py --model qwen2.5-coder-1.5b \
        --questions /work/shared/data/spec_bench/question.jsonl
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

import numpy as np

from specdec.formats.hub import resolve_model
from specdec.heads.token_freq import DATA, count_tokens, fingerprint, ranking
from specdec.formats.tokenizer import Tokenizer


def stdlib_sources() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not ({"test", "tests", "site-packages", "idlelib", "lib2to3"} & set(p.relative_to(root).parts)))
    return [f.read_text(encoding="utf-8", errors="ignore") for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a model whose tokenizer to count with")
    ap.add_argument("--questions", required=True, help="Spec-Bench's question.jsonl")
    ap.add_argument("--top", type=int, default=65536, help="token ids to keep")
    args = ap.parse_args()
    tok = Tokenizer(resolve_model(args.model, progress=False))
    texts = [t for line in Path(args.questions).read_text().splitlines() if line.strip()
             for t in json.loads(line)["turns"]]
    texts += stdlib_sources()
    counts = count_tokens(tok.hf, texts, len(tok.hf))
    top = ranking(counts)[:args.top]
    DATA.mkdir(parents=True, exist_ok=True)
    out = DATA / f"{fingerprint(tok.hf)}.npy"
    np.save(out, top.astype(np.uint32))
    print(f"{out}: {len(top)} ids from {int(counts.sum())} tokens of {len(texts)} texts; "
          f"{int((counts > 0).sum())} distinct tokens seen")


if __name__ == "__main__":
    main()
