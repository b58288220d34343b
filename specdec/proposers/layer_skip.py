"""Self-speculation by layer skipping, with SWIFT's on-the-fly layer selection (Xia et al. 2024,
"SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration").

The target drafts for itself with a subset of its layers skipped: no second model, no training,
the same KV cache. Drafting writes the run layers' keys at the draft positions; verification feeds
the same positions through every layer and overwrites them, so the cache verification reads is
always the full model's (the position-addressed cache needs no rollback). Which layers to skip is
searched while generating: each candidate set is scored by the tokens it actually gets accepted
per second of drafting and verifying with it (SWIFT's acceptance-weighted speed, measured).

On a CPU a bf16 forward is bound by reading the weights, so a draft that runs half the layers
costs half a step and rarely pays. ``drafter`` may therefore be a quantized copy of the target
(``quantization='int4'``: the target's own weights at 4 bits, its embedding shared): it reads a
third of the bytes per layer, drafts from the target's own full-precision cache, and needs no
prefill of its own. The search may then skip no layer at all. With ``tree_topk`` it drafts a
dynamic tree (EAGLE-2's, ``proposers.tree``) in the target's cache, past the pending token.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from specdec.config import QUANTIZATIONS
from specdec.errors import SpecdecError
from specdec.models.llama import Transformer
from specdec.heads.reduced_head import ReducedHead, reduced_logits
from specdec.proposers.base import Draft, Proposer, autoregressive_draft, draft_budget
from specdec.proposers.draft_vocab import DraftVocabOptions
from specdec.proposers.options import option
from specdec.proposers.tree import dynamic_tree
from specdec.models.runner import ModelRunner
from specdec.runtime.sequence import Sequence


@dataclass(frozen=True)
class LayerSkipOptions(DraftVocabOptions):
    method = "layer_skip"
    summary = "self-speculation: the target drafts with layers skipped, or with its own weights quantized"

    quantization: str | None = option(None, choices=QUANTIZATIONS, flag="--speculative-quantization",
                                      help="draft with the target's own weights at these bits (a quantized "
                                           "self-draft, measured best on a CPU); the target itself when unset")
    skip_ratio: float | None = option(None, lo=0.0, hi=1.0, hi_open=True,
                                      help="share of layers skipped at first (unset: 0.45; 0 with quantization)")
    skip_layers: list | None = option(None, items=int, help="a fixed list of layer indices to skip (no search)")
    search_steps: int | None = option(None, lo=0, help="steps of SWIFT's on-the-fly layer search per run "
                                                       "(unset: 64; 0 with quantization)")
    draft_confidence_threshold: float = option(0.6, lo=0.0, hi=1.0, hi_open=True,
                                               help="stop a draft after a token the draft gives less than this "
                                                    "probability")

    @property
    def ratio(self) -> float:
        return (0.0 if self.quantization else 0.45) if self.skip_ratio is None else self.skip_ratio

    def check(self) -> None:
        super().check()
        if not self.quantization and self.ratio <= 0.0:
            raise SpecdecError(f"skip_ratio must be in (0, 1) without quantization (the target must skip "
                               f"something to draft), got {self.ratio!r}")

    def build(self, store) -> "LayerSkipProposer":
        n = store.target.config.num_hidden_layers
        if n < 3:
            raise SpecdecError(f"layer_skip needs a model with at least 3 layers (this one has {n}): use "
                               "draft_model or ngram")
        layers = self.skip_layers
        if layers is not None:
            if not layers or not all(0 <= i < n for i in layers) or len(set(layers)) >= n:
                raise SpecdecError(f"skip_layers must be a non-empty list of layer indices in 0..{n - 1}, "
                                   "leaving at least one layer to run")
            layers = frozenset(layers)
        steps = (0 if self.quantization else 64) if self.search_steps is None else self.search_steps
        drafter = store.self_draft(self.quantization) if self.quantization else None
        head = self.reduced_head(store, drafter if drafter is not None else store.target.model)
        return LayerSkipProposer(store.target.model, store.runner, self.ratio, self.draft_confidence_threshold,
                                 steps, layers, drafter=drafter, tree_topk=self.tree_topk, tree_depth=self.tree_depth,
                                 head=head)


def skippable(n_layers: int) -> list[int]:
    """Layers that may be skipped: all but the first and last two (one, in models under 8 layers)."""
    edge = 2 if n_layers >= 8 else 1
    return list(range(edge, n_layers - edge))


def initial_skip_set(n_layers: int, ratio: float) -> frozenset[int]:
    """Skip about ``ratio`` of the layers, evenly spread over the skippable middle (ratio 0: none)."""
    inner = skippable(n_layers)
    want = min(len(inner), max(1, round(ratio * n_layers))) if ratio > 0 else 0
    if want == 0:
        return frozenset()
    step = len(inner) / want
    return frozenset(inner[int(i * step)] for i in range(want))


@dataclass
class Trial:
    skip: frozenset[int]
    steps: int = 0
    emitted: int = 0  # accepted + 1 per row-step
    cost: float = 0.0  # seconds measured, or (without timings) units of one full forward

    def score(self) -> float:
        return self.emitted / self.cost if self.cost else 0.0


@dataclass
class LayerSearch:
    """Local search over skip sets, scored by tokens emitted per unit of cost.

    The cost of a step is its measured seconds (drafting and verifying) when the proposer reports
    them; without timings a step drafting ``d`` tokens with ``s`` of ``L`` layers skipped is
    modelled as ``1 + d * (L - s) / L`` full forwards (verification of a short block costs about
    one forward on this CPU). Each candidate is used for ``trial_steps`` steps; a neighbour (one
    skipped layer swapped for a run one, or one added or removed, down to ``min_skip``) replaces
    the incumbent if it scores higher. After ``search_steps`` steps the best set is kept.
    """

    n_layers: int
    ratio: float = 0.45
    trial_steps: int = 4
    search_steps: int = 64
    seed: int = 0
    initial: frozenset[int] | None = None  # start here instead of the evenly spread set
    min_skip: int = 1  # fewest layers a candidate skips (0 for a quantized drafter)
    best: Trial = field(init=False)
    current: Trial = field(init=False)
    steps: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        start = self.initial if self.initial is not None else initial_skip_set(self.n_layers, self.ratio)
        self.best = self.current = Trial(frozenset(start))

    @property
    def searching(self) -> bool:
        return self.steps < self.search_steps

    def skip_set(self) -> frozenset[int]:
        return self.current.skip

    def report(self, drafted: list[int], accepted: list[int], seconds: float | None = None) -> None:
        """One verification step with the current set: per-row drafted and accepted counts, and
        the step's measured seconds if known (use timings for every step of a search or none)."""
        t = self.current
        frac_run = (self.n_layers - len(t.skip)) / self.n_layers
        t.steps += 1
        t.emitted += sum(a + 1 for a in accepted)
        t.cost += seconds if seconds is not None else len(drafted) * 1.0 + sum(drafted) * frac_run
        self.steps += 1
        if t.steps < self.trial_steps:
            return
        if t is not self.best and t.score() > self.best.score():
            self.best = t
        if self.searching:
            self.current = Trial(self.neighbour(self.best.skip))
        else:
            self.current = self.best

    def neighbour(self, skip: frozenset[int]) -> frozenset[int]:
        inner = set(skippable(self.n_layers))
        skipped, run = sorted(skip), sorted(inner - skip)
        move = self.rng.choice(["swap", "add", "remove"])
        s = set(skip)
        if move == "swap" and skipped and run:
            s.remove(self.rng.choice(skipped))
            s.add(self.rng.choice(run))
        elif move == "add" and run:
            s.add(self.rng.choice(run))
        elif len(skipped) > self.min_skip:
            s.remove(self.rng.choice(skipped))
        return frozenset(s)


class LayerSkipProposer(Proposer):
    """Drafts with the target itself, some layers skipped, in the target's own cache rows.

    ``drafter``: a quantized copy of the target to draft with (same architecture and cache
    layout); None drafts with the target's own weights.
    """

    def __init__(self, target: Transformer, runner: ModelRunner, ratio: float = 0.45,
                 confidence_threshold: float = 0.6, search_steps: int = 64,
                 skip_layers: frozenset[int] | None = None, seed: int = 0,
                 drafter: Transformer | None = None, tree_topk: int = 0, tree_depth: int = 4,
                 head: ReducedHead | None = None) -> None:
        self.model, self.runner = drafter if drafter is not None else target, runner
        self.head = head  # a frequency-ranked head (draft_vocab_size), else the drafter's own
        self.confidence_threshold = confidence_threshold
        self.search_args = dict(n_layers=target.config.num_hidden_layers, ratio=ratio, seed=seed,
                                search_steps=0 if skip_layers is not None else search_steps,
                                initial=skip_layers, min_skip=0 if drafter is not None else 1)
        self.search = LayerSearch(**self.search_args)
        self.last_budget: list[int] = []
        self.started = 0.0  # when the current step's drafting began
        self.tree_topk, self.tree_depth = tree_topk, tree_depth

    def lookahead(self) -> int:
        return self.tree_topk * (self.tree_depth - 1)  # a tree's fed nodes may outnumber K

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        self.search = LayerSearch(**self.search_args)  # a new run searches afresh (SWIFT: per input)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        self.started = time.perf_counter()
        dev = self.runner.device
        budget = draft_budget(seqs, ks)
        skip = self.search.skip_set()
        rows = torch.tensor([s.row for s in seqs], device=dev)
        pos = torch.tensor([[s.num_tokens - 1] for s in seqs], device=dev)  # (B, 1) the pending token
        nxt = torch.tensor([[s.tokens[-1]] for s in seqs], device=dev)

        def next_logits(j: int, prev: torch.Tensor | None) -> torch.Tensor:
            tok = nxt if prev is None else prev[:, None]
            return reduced_logits(self.model, self.head, tok, pos + j, self.runner.cache, at="last", rows=rows,
                                  skip_layers=skip)[:, -1]

        if self.tree_topk:  # fed node f goes to the slot after the pending token + f
            def forward(tokens: torch.Tensor, depth: torch.Tensor, fed: int, mask: torch.Tensor) -> torch.Tensor:
                slots = pos + 1 + fed + torch.arange(tokens.shape[1], device=dev)  # (B, W)
                return reduced_logits(self.model, self.head, tokens, pos + depth, self.runner.cache, rows=rows,
                                      cache_pos=slots, attn_mask=mask, skip_layers=skip)

            draft = dynamic_tree(next_logits(0, None), budget, self.tree_topk, self.tree_depth, forward, seqs,
                                 gumbel=self.verify == "gumbel").draft
            budget = draft.num_tokens.tolist()
        else:
            draft = autoregressive_draft(seqs, budget, next_logits, self.confidence_threshold, dev,
                                    gumbel=self.verify == "gumbel")
        self.last_budget = budget
        return draft

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        if self.last_budget:
            self.search.report(self.last_budget, num_accepted, time.perf_counter() - self.started)
        self.last_budget = []
