"""Cascades: a cheaper proposer drafts for a stronger drafter, which drafts for the target
(e.g. n-gram -> qwen2.5-coder-0.5b -> qwen2.5-coder-1.5b; cf. Chen et al. 2024, "Cascade
Speculative Drafting").

The drafter makes its k tokens with the engine's own speculative step (``engine.step``), run on the
drafter: the cheaper proposer drafts, the drafter verifies. Each stage is therefore lossless with
respect to the next: greedy drafts are exactly the drafter's greedy tokens, sampled drafts follow
the drafter's distribution, and the target is handed that distribution as the draft's q (the
verification pass of the drafter computed it), so its acceptance is sum(min(p, q)), not the
sum(p * q) of a one-hot draft.

Each request keeps one draft run (``_DraftRun``) for its whole life: the inner stage's draft-length
policy (adaptive K, measured-speed pauses) keys its state on it and keeps it from one outer step to
the next; it is dropped when the request leaves.

The drafter is either a draft model with its own cache, or the target's own weights quantized
(``shared``: the target's runner), which drafts in the target's cache rows like layer_skip's
quantized self-draft: no prefill or catch-up of its own. It writes only slots past the pending
token, and the target's verification rewrites every slot it keeps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.config import QUANTIZATIONS
from specdec.engine.policies import draft_lengths, make_policy
from specdec.engine.step import accept, speculative_step
from specdec.errors import SpecdecError
from specdec.proposers.base import Draft, Proposer, autoregressive_draft, draft_budget
from specdec.proposers.draft_model import DraftModelOptions
from specdec.proposers.layer_skip import LayerSkipOptions
from specdec.proposers.ngram import NgramOptions
from specdec.proposers.options import SpecOptions, option
from specdec.models.runner import ModelRunner
from specdec.runtime.sequence import Sequence


@dataclass(frozen=True)
class _CascadeBase(SpecOptions):
    """The n-gram stage's options, shared by both cascades, and the build from two stage configs."""

    prompt_lookup_min: int = option(1, lo=1, hi=64, help="shortest n-gram to match")
    prompt_lookup_max: int = option(4, lo=1, hi=64, help="longest n-gram to match")
    stage_tokens: int = option(3, lo=1, hi=32, help="draft length of the n-gram stage")

    def stage_configs(self) -> list[dict]:
        raise NotImplementedError

    def lookup_stage(self) -> dict:
        return {"method": "ngram", "num_speculative_tokens": self.stage_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}

    def build(self, store) -> "CascadeProposer":
        from specdec.proposers.registry import parse_config  # noqa: PLC0415 (the registry imports this module)
        stages = self.stage_configs()
        if len(stages) != 2:
            raise SpecdecError("a cascade needs 'stages': [cheap proposer, drafter], cheapest first")
        inner, last = (parse_config(st, f"the cascade's stage {i + 1}") for i, st in enumerate(stages))
        self_draft = isinstance(last, LayerSkipOptions) and last.quantization is not None
        if not isinstance(inner, NgramOptions) or not (isinstance(last, DraftModelOptions) or self_draft):
            raise SpecdecError("cascade stages must be an 'ngram' stage followed by a 'draft_model' stage or a "
                               "quantized self-draft {'method': 'layer_skip', 'quantization': 'int4'}, got "
                               f"{inner.method!r} then {last.method!r}"
                               + (" without quantization" if last.method == "layer_skip" else ""))
        kept = {"method", "model", "quantization", "num_speculative_tokens"}
        defaults = type(last).parse({"model": "x"} if isinstance(last, DraftModelOptions) else {}).to_dict()
        extra = sorted(k for k, v in last.to_dict().items() if k not in kept and v != defaults[k])
        if extra:
            raise SpecdecError(f"the cascade's {last.method} stage takes no {', '.join(extra)}"
                               + (" (its self-draft runs every layer)" if self_draft else ""))
        adaptive = self.adaptive or inner.adaptive  # the n-gram stage adapts too (its K, its pauses)
        lookup = inner.build(store)
        if self_draft:
            return CascadeProposer(ModelRunner(store.self_draft(last.quantization)), lookup,
                                   inner.num_speculative_tokens, shared=store.runner, adaptive=adaptive)
        return CascadeProposer(ModelRunner(store.draft(last.model, last.quantization)), lookup,
                               inner.num_speculative_tokens, adaptive=adaptive)


@dataclass(frozen=True)
class CascadeOptions(_CascadeBase):
    method = "cascade"
    summary = "n-gram lookup drafts for a draft model, which drafts for the target"

    stages: list | None = option(None, items=dict, cli=False,
                                 help="[cheap stage, drafter] configs, cheapest first: an ngram stage, then a "
                                      "draft_model stage or a quantized layer_skip self-draft; unset: built "
                                      "from the other options")
    model: str | None = option(None, flag="--speculative-model", help="the draft model (when stages is unset)")
    quantization: str | None = option(None, choices=QUANTIZATIONS, flag="--speculative-quantization",
                                      help="the draft model's weights (when stages is unset)")

    def stage_configs(self) -> list[dict]:
        if self.stages is not None:
            return self.stages
        return [self.lookup_stage(), {"method": "draft_model", "model": self.model, "quantization": self.quantization}]

    def check(self) -> None:
        if self.stages is not None and self.model is not None:
            raise SpecdecError("a cascade takes 'stages' or 'model', not both")
        if self.stages is None and self.model is None:
            raise SpecdecError("a cascade needs a draft model ('model'; CLI: --speculative-model) or 'stages': "
                               "[cheap proposer, drafter], e.g. [{'method': 'ngram'}, {'method': "
                               "'draft_model', 'model': 'qwen2.5-coder-0.5b'}]")


@dataclass(frozen=True)
class CascadeSelfOptions(_CascadeBase):
    method = "cascade-self"
    summary = "n-gram lookup drafts for the target's own weights quantized, which draft for the target"

    quantization: str = option("int4", choices=QUANTIZATIONS, flag="--speculative-quantization",
                               help="bits of the self-draft (the target's own weights)")

    def stage_configs(self) -> list[dict]:
        return [self.lookup_stage(), {"method": "layer_skip", "quantization": self.quantization}]


@dataclass(eq=False)
class _DraftRun(Sequence):
    """A request as its drafter sees it: the request's tokens plus the draft made so far, ended after
    ``budget`` drafted tokens. One per request, kept across steps (token list updated in place)."""

    synced: int = 0  # leading tokens known to equal the request's
    # its verification's random draws (sampling.rng): independent of the outer verifier's, which
    # rejection sampling needs of its drafts (Gumbel verification shares the noise on purpose)
    noise_stage: int = 1
    probs: list = field(default_factory=list)  # per drafted token: its (V,) distribution, or None

    def sync(self, seq: Sequence, head: list[int], head_probs: list, budget: int) -> None:
        """Become ``seq``'s tokens + ``head``, with room for ``budget`` more drafted tokens."""
        del self.tokens[self.synced:]
        self.tokens.extend(seq.tokens[self.synced:])
        self.synced = len(self.tokens)
        self.tokens.extend(head)
        self.output_ids, self.probs = list(head), list(head_probs)
        self.prompt_ids = seq.prompt_ids  # penalties count the tokens after the request's prompt
        self.finish_reason = None
        if self.params.max_tokens != max(len(head) + budget, 1) or self.params.temperature != seq.params.temperature:
            self.params = seq.params.replace(max_tokens=max(len(head) + budget, 1), stop=(), ignore_eos=True,
                                             logprobs=None, prompt_logprobs=None)

    def append(self, token_ids: list[int]) -> int:
        take = token_ids[:max(self.params.max_tokens - len(self.output_ids), 0)]
        self.output_ids.extend(take)
        self.tokens.extend(take)
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        return len(take)


class CascadeProposer(Proposer):
    """The last stage (a draft model's runner) verifies the drafts of ``inner``."""

    def __init__(self, runner: ModelRunner, inner: Proposer, inner_k: int, shared: ModelRunner | None = None,
                 adaptive: bool = False) -> None:
        self.runner, self.inner, self.inner_k, self.shared = runner, inner, inner_k, shared
        self.policy = make_policy(inner_k, adaptive)  # the inner stage's draft length, per draft run
        self.valid: dict[int, int] = {}  # row -> leading positions of the drafter's cache holding real tokens
        self.n_before: dict[int, int] = {}  # row -> sequence length when its draft was made
        self.runs: dict[str, _DraftRun] = {}  # request id -> its draft run

    def set_verify(self, mode: str) -> None:
        """The inner stage's verification (the drafter's step) follows the same rule: under "gumbel"
        the drafter's tokens are its own Gumbel-max tokens with the target's noise."""
        self.verify = mode
        self.inner.set_verify(mode)

    def lookahead(self) -> int:
        return self.inner_k + 1  # the inner loop may write this many slots past the outer draft

    def prepare(self, rows: int, max_len: int, num_blocks: int | None = None) -> None:
        if self.shared is not None:  # draft in the target's own cache
            self.runner.cache = self.shared.ensure_cache(rows, max_len)
        else:
            self.runner.num_blocks = num_blocks
            self.runner.ensure_cache(rows, max_len)
        self.inner.prepare(rows, max_len, num_blocks)

    def add(self, seq: Sequence) -> None:
        if self.shared is None:  # the drafter's own prefix cache
            cached = self.runner.reuse_prefix(seq.row, seq.tokens[:-1])
            self.runner.prefill(seq.row, seq.tokens[cached:-1], start=cached)
            self.runner.offer_prefix(seq.row, seq.tokens[:-1])
        self.valid[seq.row] = seq.num_tokens - 1
        params = seq.params.replace(logprobs=None, prompt_logprobs=None)  # the drafter's are never read
        run = _DraftRun(request_id=f"{seq.request_id}/draft", prompt=None, prompt_ids=[], params=params,
                        detokenizer=None, eos_ids=frozenset(), max_len=seq.max_len + self.lookahead(),
                        seed=seq.seed, row=seq.row)
        self.runs[seq.request_id] = run
        self.inner.add(run)

    def remove(self, seq: Sequence) -> None:
        self.valid.pop(seq.row, None)
        self.n_before.pop(seq.row, None)
        run = self.runs.pop(seq.request_id, None)
        if run is not None:
            self.inner.remove(run)
            self.policy.forget(run)
        if self.shared is None and self.runner.cache is not None:
            self.runner.cache.free(seq.row)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Draft:
        budget = draft_budget(seqs, ks)
        live: list[_DraftRun] = []
        for s, kb in zip(seqs, budget):
            # catch the drafter up to the sequence (the tokens it has not seen, but the pending one)
            lo = s.num_tokens - 1 if self.shared is not None else self.valid[s.row]  # shared: verified
            head, head_probs = [], []
            if lo == s.num_tokens - 2 and kb > 0:
                # one token behind (the target kept the whole last draft): feed it with the pending
                # token in one forward, whose last logits give the first draft token
                head, head_probs = self._catch_up_and_draft(s, lo)
            elif lo < s.num_tokens - 1:
                self.runner.prefill(s.row, s.tokens[lo:s.num_tokens - 1], start=lo)
            run = self.runs[s.request_id]
            run.sync(s, head, head_probs, max(kb - len(head), 0))
            if kb > len(head):
                live.append(run)
        while live:  # the drafter verifies its inner stage's drafts, one engine step at a time
            out = speculative_step(self.runner, self.inner, live, draft_lengths(self.policy, live, self.verify))
            for i, (run, em) in enumerate(zip(live, out.emitted)):
                # each emitted token follows the drafter's distribution at its position: its q
                run.probs.extend(None if out.target_probs is None else out.target_probs[i, j] for j in range(len(em)))
            failed = accept(live, out, self.inner, self.policy)
            if failed:  # a draft run's own error: the outer step's propose raises (no row changed there)
                raise failed[0][1]
            live = [r for r in live if not r.finished]
        runs = [self.runs[s.request_id] for s in seqs]
        drafts = [r.output_ids[:kb] for r, kb in zip(runs, budget)]
        for s, d in zip(seqs, drafts):
            # the drafter's cache now holds the sequence and all but the last drafted token
            self.valid[s.row] = s.num_tokens - 1 + len(d)
            self.n_before[s.row] = s.num_tokens
        width = max(map(len, drafts), default=0)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, d in enumerate(drafts):
            tokens[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        return Draft(tokens=tokens, num_tokens=torch.tensor([len(d) for d in drafts]),
                     probs=self._draft_probs(runs, drafts, width))

    @staticmethod
    def _draft_probs(runs: list[_DraftRun], drafts: list[list[int]], width: int) -> torch.Tensor | None:
        """(B, K, V): the drafter's distribution of each drafted token (its real q), or None when every
        row was greedy (a deterministic draft). Padding and greedy rows hold a one-hot at their token."""
        rows = [r.probs[:len(d)] for r, d in zip(runs, drafts)]
        sample = next((p for ps in rows for p in ps if p is not None), None)
        if sample is None or width == 0:
            return None
        out = torch.zeros(len(runs), width, sample.shape[-1], dtype=sample.dtype)
        for i, (ps, d) in enumerate(zip(rows, drafts)):
            for j, (p, tok) in enumerate(zip(ps, d)):
                if p is None:
                    out[i, j, tok] = 1.0
                else:
                    out[i, j] = p
        return out

    @torch.inference_mode()
    def _catch_up_and_draft(self, s: Sequence, lo: int) -> tuple[list[int], list]:
        """Feed tokens ``lo..`` (the missing one and the pending one) to the drafter; its next token,
        chosen as every drafter token is (``autoregressive_draft``: argmax or the request's sampling),
        and the distribution it was drawn from (None: greedy)."""
        dev = self.runner.device
        logits = self.runner.forward(torch.tensor([s.tokens[lo:]], device=dev),
                                     torch.arange(lo, s.num_tokens, device=dev)[None],
                                     torch.tensor([s.row], device=dev), logits_positions="last").logits[:, -1]
        d = autoregressive_draft([s], [1], lambda j, prev: logits, 0.0, dev, gumbel=self.verify == "gumbel")
        return [int(d.tokens[0, 0])], [None if d.probs is None else d.probs[0, 0]]

    def on_accept(self, seqs: list[Sequence], num_accepted: list[int]) -> None:
        for s, a in zip(seqs, num_accepted):
            n = self.n_before.pop(s.row, None)
            if n is not None:
                # drafted tokens beyond the accepted ones are not the sequence's: their keys are stale
                self.valid[s.row] = min(self.valid[s.row], n + a)
