"""The options of a frequency-ranked draft head (FR-Spec), shared by draft_model and layer_skip."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.errors import SpecdecError
from specdec.models.llama import Transformer
from specdec.heads.reduced_head import ReducedHead
from specdec.heads.token_freq import draft_vocab, shipped_ranking
from specdec.proposers.options import option
from specdec.proposers.tree import TreeOptions


@dataclass(frozen=True)
class DraftVocabOptions(TreeOptions):
    """A drafter whose LM head may keep only the most frequent target tokens."""

    #: the draft vocabulary when draft_vocab_size is unset and a ranking ships for the tokenizer (None: full)
    auto_vocab_size: ClassVar[int | None] = None

    draft_vocab_size: int | None = option(None, lo=0, help="the drafter's LM head keeps only the N most frequent "
                                                           "target tokens (FR-Spec): each drafted token reads N "
                                                           "rows; 0: the full head; unset: the method's measured "
                                                           "default")
    draft_vocab_corpus: str | None = option(None, help="a text file or directory to rank tokens on for "
                                                       "draft_vocab_size; unset: the ranking shipped for the "
                                                       "tokenizer (Qwen2.5: Spec-Bench and CPython sources)")

    def check(self) -> None:
        super().check()
        if self.draft_vocab_corpus is not None and not self.draft_vocab_size:
            raise SpecdecError("draft_vocab_corpus ranks tokens for draft_vocab_size: set draft_vocab_size too")

    def vocab_size_for(self, hf, vocab_size: int) -> int:
        """The draft vocabulary to cut the head to (0: the full head). Unset: ``auto_vocab_size`` where a
        ranking ships for this tokenizer and it is under half the vocabulary, else the full head."""
        if self.draft_vocab_size is not None:
            return self.draft_vocab_size
        n = self.auto_vocab_size
        return n if n and 2 * n <= vocab_size and shipped_ranking(hf) is not None else 0

    def reduced_head(self, store, model: Transformer) -> ReducedHead | None:
        """The drafter ``model``'s head cut to the draft vocabulary, or None for the full head."""
        tok = store.target.tokenizer
        n = self.vocab_size_for(tok.hf, store.target.config.vocab_size)
        if not n:
            return None
        ids = draft_vocab(tok.hf, store.target.config.vocab_size, n, self.draft_vocab_corpus,
                          always=set(tok.eos_token_ids))
        return ReducedHead(model, ids)
