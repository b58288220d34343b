"""The target's own multi-token-prediction layers as its drafter (``heads/mtp.py``: GLM-4.5's
``num_nextn_predict_layers``, DeepSeek-V3's MTP modules, Qwen3.5's and Qwen3-Next's ``mtp.*`` block, also from a
GGUF file of ``qwen35``), drafting as transformers' ``MTPCandidateGenerator`` does (``generate(...,
use_mtp=True)``) and, for Qwen3.5's one layer, as vLLM's MTP proposer does, in a position-addressed KV cache of
their own. A hybrid target (Qwen3.5's delta-nets) changes nothing here: the MTP layer is full attention, and
it reads only the target's hidden states, which verification returns whatever the target's layers are.

With N tokens (positions 0..N-1, the last one pending) the target's final-norm hidden states are known up
to m = N - 2. MTP layer i's entry p reads ``h_p`` (layer 0: the target's; layer i: layer i - 1's output
at p) and token ``x_{p+1+i}``; its entry m drafts token i + 1 (position m + 2 + i). So the entries
p > m - i of layer i read drafted tokens: they are the step's guesses, redone at the next step once the
target has verified them (``done``: per row and layer, the first entry not known to be right), exactly
as transformers' generator crops and recomputes its MTP cache. A draft longer than the layers (GLM-4.5
has one) goes on with the last layer on its own output: entry m + 1 reads the output at m and the token
just drafted, and so on (vLLM's reuse of a single MTP layer), its keys in slots the next step overwrites.

Life cycle per row: the prompt's prefill gives the hidden states of positions 0..N-2; each verification
adds those of the positions it kept (``on_verified`` / ``on_accept``); ``propose`` runs layers
0..min(K, layers) - 1 over the entries from the first one some layer lacks to m (one pass per layer, all
rows at once), then the reuse steps, one entry per row each. A layer a step does not run (K below the
layers) catches up when a later step runs it: the hidden states it lacks are kept until then. Tokens
are chosen by the shared drafting loop (``autoregressive_draft``: greedy, sampled with the request's own
parameters, penalties, grammar).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specdec.quant.linear import pack_linears
from specdec.heads.mtp import MtpModel, load_mtp
from specdec.proposers.base import Draft, Proposer, autoregressive_draft, draft_budget, empty_draft
from specdec.proposers.options import SpecOptions, option
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.sequence import Sequence


@dataclass(frozen=True)
class MtpOptions(SpecOptions):
    method = "mtp"
    summary = ("the target's own multi-token-prediction layers (GLM-4.5's and Qwen3.5's MTP) draft from its hidden states: "
               "no second model, no training")

    draft_confidence_threshold: float = option(0.0, lo=0.0, hi=1.0, hi_open=True,
                                               help="stop a draft after a token the MTP layers give less than "
                                                    "this probability")

    def build(self, store) -> "MtpProposer":
        target = store.target
        mtp = load_mtp(target.hf_dir(), target.config, dtype=store.dtype, device=store.device)
        pack_linears(mtp)  # bf16 on the CPU: the native tiles (or oneDNN's layout); else nothing changes
        return MtpProposer(mtp, target.model.embed_tokens, target.model.lm_head, self.draft_confidence_threshold)


@dataclass
class Row:
    """One row's state: the target's hidden states from position ``start`` on, and per MTP layer the first
    entry its cache does not hold rightly."""

    start: int
    done: list[int]
    feats: list[torch.Tensor] = field(default_factory=list)  # (t, C) pieces, positions start..

    @property
    def end(self) -> int:
        """One past the last position whose hidden state the row holds."""
        return self.start + sum(f.shape[0] for f in self.feats)


class MtpProposer(Proposer):
    """Drafts with the target's MTP layers (``MtpModel``), its embedding and its LM head."""

    hidden_layers = (-1,)  # the target's last layer after its final norm (transformers' hidden_states[-1])

    def __init__(self, mtp: MtpModel, embed: nn.Module, lm_head: nn.Module, confidence_threshold: float = 0.0) -> None:
        self.mtp, self.embed, self.lm_head = mtp, embed, lm_head
        self.n_layers = len(mtp.layers)
        self.confidence_threshold = confidence_threshold
        self.cache: KVCache | None = None
        self.rows: dict[int, Row] = {}
        self.verified: torch.Tensor | None = None  # (B, 1+K, C) the last verification's hidden states

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        # one slot more than the target's: padded entries of a ragged batch and the last reuse step write there
        if self.cache is None:
            self.cache = self.mtp.new_cache(rows, max_len + 1, num_blocks)
        else:
            self.cache.grow(rows, max_len + 1, num_blocks)

    def reuse_prefix(self, seq: Sequence) -> int | None:
        # the MTP layers read the hidden state of every prompt position: the target prefills it all
        if self.cache is not None:
            self.cache.free(seq.row)
        return 0

    def on_prefill(self, seq: Sequence, start: int, forward) -> None:
        r = self.rows.get(seq.row)
        if start == 0 or r is None or r.end != start:  # a new request in this row
            r = self.rows[seq.row] = Row(start, [start] * self.n_layers)
        r.feats.append(forward.hidden[-1][0])  # (T, C) positions start..

    def add(self, seq: Sequence) -> None:
        r = self.rows.get(seq.row)
        if r is None or r.end != seq.num_tokens - 1:  # a one-token prompt: nothing read
            self.rows[seq.row] = Row(seq.num_tokens - 1, [seq.num_tokens - 1] * self.n_layers)

    def remove(self, seq: Sequence) -> None:
        self.rows.pop(seq.row, None)
        if self.cache is not None:
            self.cache.free(seq.row)

    def on_verified(self, seqs: list[Sequence], forward) -> None:
        self.verified = forward.hidden[-1]

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        hidden, self.verified = self.verified, None
        if hidden is None:
            return
        for i, (s, a) in enumerate(zip(seqs, num_accepted)):
            r = self.rows.get(s.row)
            if r is None:
                continue
            start = s.num_tokens - a - 2  # the block verified started at the pending token's position
            if r.end != start:  # a gap (cannot happen in the engine): start afresh there
                r = self.rows[s.row] = Row(start, [start] * self.n_layers)
            r.feats.append(hidden[i, :a + 1])

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        dev = self.mtp.layers[0].enorm.weight.device
        B = len(seqs)
        budget = draft_budget(seqs, ks)
        rows = [self.rows[s.row] for s in seqs]
        last = [s.num_tokens - 2 for s in seqs]  # m: the last position with a hidden state
        block = min(max(budget, default=0), self.n_layers)  # layers run over the entries (the rest: reuse steps)
        first = [min(r.done[:max(block, 1)]) for r in rows]  # p0: the first entry some running layer lacks
        count = [max(m - p0 + 1, 0) for m, p0 in zip(last, first)]
        budget = [b if n else 0 for b, n in zip(budget, count)]  # nothing to read (a one-token prompt): no draft
        if max(budget, default=0) == 0:
            return empty_draft(B, dev)
        M = max(count)
        dtype = self.mtp.layers[0].enorm.weight.dtype
        C = self.mtp.config.hidden_size
        hidden = torch.zeros(B, M, C, dtype=dtype, device=dev)  # (B, M, C) layer 0 reads the target's
        for i, (r, p0, n) in enumerate(zip(rows, first, count)):
            if n:
                feats = torch.cat(r.feats) if len(r.feats) > 1 else r.feats[0]
                hidden[i, :n] = feats[p0 - r.start:p0 - r.start + n].to(dtype)
        t = torch.arange(M, device=dev)
        p0s = torch.tensor(first, device=dev).view(B, 1)
        ends = torch.tensor(last, device=dev).view(B, 1)
        real = t.view(1, M) < torch.tensor(count, device=dev).view(B, 1)  # (B, M)
        top = self.cache.max_len - 1
        # entry p at slot p; a row's padding writes slot m + 1 (which the next read of it overwrites)
        slots = torch.where(real, p0s + t, ends + 1).clamp(0, top)
        entries = torch.where(real, p0s + t, ends)  # (B, M) the entry each query stands for (padding: m)
        rows_t = torch.tensor([s.row for s in seqs], device=dev)
        lastidx = torch.tensor([max(n - 1, 0) for n in count], device=dev)
        drafted: list[torch.Tensor] = []  # (B,) each
        state: dict[str, torch.Tensor] = {}
        ran = [0]

        def tokens_at(positions: torch.Tensor) -> torch.Tensor:
            """``(B, M)`` the token at each position: the row's own, or a draft of this step."""
            out = torch.zeros_like(positions)
            ahead = torch.stack(drafted, 1).tolist() if drafted else [[] for _ in seqs]  # (B, j)
            for i, s in enumerate(seqs):
                lo = int(positions[i].min())
                known = torch.tensor(s.tokens[lo:] + ahead[i], device=dev)
                out[i] = known[(positions[i] - lo).clamp(max=len(known) - 1)]
            return out

        def next_logits(j: int, prev: torch.Tensor | None) -> torch.Tensor:
            if prev is not None:
                drafted.append(prev)
            if j < block:  # layer j over every entry: tokens x_{p+1+j}
                toks = tokens_at((entries + 1 + j).clamp(min=0))
                out = self.mtp(j, self.embed(toks).to(dtype), state.get("block", hidden), entries + 1 + j, slots,
                               self.cache, rows_t)
                state["block"] = out
                state["h"] = out[torch.arange(B, device=dev), lastidx].unsqueeze(1)  # (B, 1, C) entry m
                ran[0] = j + 1
            else:  # the last layer again, on its own output: entry m + j - L + 1, token = the draft just made
                p = ends + j - self.n_layers + 1  # (B, 1)
                state["h"] = self.mtp(self.n_layers - 1, self.embed(prev[:, None]).to(dtype), state["h"],
                                      p + self.n_layers, p.clamp(max=top), self.cache, rows_t)
            return self.lm_head(state["h"][:, 0]).float()  # (B, V)

        draft = autoregressive_draft(seqs, budget, next_logits, self.confidence_threshold, dev,
                                     gumbel=self.verify == "gumbel")
        for r, p0, m, n in zip(rows, first, last, count):
            if not n:
                continue
            for j in range(ran[0]):  # entries p <= m - j read known tokens only
                r.done[j] = max(p0, m - j + 1)
            keep = min(r.done)  # hidden states from the first entry some layer lacks
            feats = torch.cat(r.feats) if len(r.feats) > 1 else r.feats[0]
            r.feats, r.start = [feats[keep - r.start:]], keep
        return draft
