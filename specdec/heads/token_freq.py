"""Target tokens ranked by frequency: which N rows a frequency-ranked draft head keeps (FR-Spec).

Counts come from a corpus the user names (a text file, or a directory whose files are read as
text), or from the ranking shipped for a tokenizer under ``specdec/data/token_freq/<fingerprint>.npy``:
the top 65,536 token ids of the Qwen2.5 vocabulary counted on the Spec-Bench questions and the
CPython standard library's sources (``scripts/token_counts.py`` makes it again). A tokenizer is
named by a fingerprint of its vocabulary, so the 0.5B and 1.5B Qwen2.5-Coder (one tokenizer) share one
file and a different vocabulary never reads another's ranking.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from specdec.errors import SpecdecError

DATA = Path(__file__).resolve().parent.parent / "data" / "token_freq"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".jsonl", ".json", ".c", ".h", ".js", ".ts", ".java", ".go",
                 ".rs", ".cpp", ".html", ".css", ".sh", ".yaml", ".yml", ".toml", ".csv", ".tex"}
PIECE = 1 << 16  # characters tokenized per call


def fingerprint(hf) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id, added tokens included)."""
    vocab = json.dumps(sorted(hf.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def corpus_texts(path: str | Path) -> list[str]:
    """The texts of a corpus: one file, or every text file under a directory (by suffix)."""
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    else:
        raise SpecdecError(f"draft_vocab_corpus {str(path)!r} is neither a file nor a directory")
    texts = [f.read_text(encoding="utf-8", errors="ignore") for f in files]
    if not any(texts):
        raise SpecdecError(f"draft_vocab_corpus {str(path)!r} holds no text to count tokens on")
    return texts


def count_tokens(hf, texts: list[str], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in ``texts`` (int64, ``vocab_size``)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    pieces = [t[i:i + PIECE] for t in texts for i in range(0, len(t), PIECE)]
    for lo in range(0, len(pieces), 64):
        for ids in hf(pieces[lo:lo + 64], add_special_tokens=False)["input_ids"]:
            a = np.asarray(ids, dtype=np.int64)
            counts += np.bincount(a[a < vocab_size], minlength=vocab_size)
    return counts


def ranking(counts: np.ndarray) -> np.ndarray:
    """Token ids by count, highest first (ties: lower id first)."""
    return np.lexsort((np.arange(len(counts)), -counts)).astype(np.int64)


def shipped_ranking(hf) -> np.ndarray | None:
    path = DATA / f"{fingerprint(hf)}.npy"
    return np.load(path).astype(np.int64) if path.is_file() else None


def draft_vocab(hf, vocab_size: int, n: int, corpus: str | None, always: set[int] = frozenset()) -> torch.Tensor:
    """The ``n`` target token ids a reduced draft head keeps, ascending: ``always`` (the EOS ids: a
    draft can then end where the target does) and the most frequent tokens of ``corpus`` (or of the
    shipped ranking for this tokenizer)."""
    if n >= vocab_size:
        raise SpecdecError(f"draft_vocab_size {n} is not below the vocabulary's {vocab_size} tokens: leave it unset "
                           "for the full head")
    if corpus is not None:
        ranked = ranking(count_tokens(hf, corpus_texts(corpus), vocab_size))
    else:
        ranked = shipped_ranking(hf)
        if ranked is None:
            raise SpecdecError("no shipped token ranking for this tokenizer: name a corpus to count tokens on "
                               "with draft_vocab_corpus (a text file or a directory)")
        if n > len(ranked):
            raise SpecdecError(f"the shipped ranking holds {len(ranked)} tokens: draft_vocab_size {n} needs "
                               "draft_vocab_corpus")
    keep = [i for i in sorted(always) if i < vocab_size][:n]
    seen = set(keep)
    for i in ranked.tolist():
        if len(keep) >= n:
            break
        if i not in seen and i < vocab_size:
            keep.append(i)
            seen.add(i)
    return torch.tensor(sorted(keep), dtype=torch.long)
