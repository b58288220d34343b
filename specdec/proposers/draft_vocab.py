"""The options of a frequency-ranked draft head (FR-Spec), shared by draft_model and layer_skip."""
from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import SpecdecError
from specdec.models.llama import Transformer
from specdec.models.reduced_head import ReducedHead
from specdec.models.token_freq import draft_vocab
from specdec.proposers.options import option
from specdec.proposers.tree import TreeOptions


@dataclass(frozen=True)
class DraftVocabOptions(TreeOptions):
    """A drafter whose LM head may keep only the most frequent target tokens."""

    draft_vocab_size: int | None = option(None, lo=1, help="the drafter's LM head keeps only the N most frequent "
                                                           "target tokens (FR-Spec): each drafted token reads N "
                                                           "rows; the full head when unset")
    draft_vocab_corpus: str | None = option(None, help="a text file or directory to rank tokens on for "
                                                       "draft_vocab_size; unset: the ranking shipped for the "
                                                       "tokenizer (Qwen2.5: Spec-Bench and CPython sources)")

    def check(self) -> None:
        super().check()
        if self.draft_vocab_corpus is not None and self.draft_vocab_size is None:
            raise SpecdecError("draft_vocab_corpus ranks tokens for draft_vocab_size: set draft_vocab_size too")

    def reduced_head(self, store, model: Transformer) -> ReducedHead | None:
        """The drafter ``model``'s head cut to the draft vocabulary, or None for the full head."""
        if self.draft_vocab_size is None:
            return None
        tok = store.target.tokenizer
        ids = draft_vocab(tok.hf, store.target.config.vocab_size, self.draft_vocab_size, self.draft_vocab_corpus,
                          always=set(tok.eos_token_ids))
        return ReducedHead(model, ids)
