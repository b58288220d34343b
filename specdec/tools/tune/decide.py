"""The deployment checklist's decision rule, on measurements: which drafter, which K, up to which
batch size, or no speculation at all, each choice with its reason in the checklist's words.

Pure functions over ``Measured`` records (tests feed synthetic ones). The rule, as practitioners apply
it: speculation pays when the hardware is underused at the batch sizes served (the batch sweep), the
drafter's acceptance is high enough to cover its cost (the candidates' speedups), and the answers are
long enough for the saved steps to matter; otherwise the effort goes into batching.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_SPEEDUP = 1.05  # below this a drafter is not worth its memory and complexity
LOW_ACCEPTANCE = 0.60  # a draft model below this: distill it on the target's outputs
SHORT_ANSWER = 32  # mean generated tokens below this: speculation saves little per request
VERIFY_ROWS = 8  # rows a verification forward takes at about the cost of one (bf16 CPU: BENCHMARKS.md)


@dataclass
class Measured:
    """One configuration measured on the user's prompts (batch 1 unless ``batch``)."""

    name: str  # candidate name, e.g. "ngram", "draft:qwen2.5-coder-0.5b"
    spec: dict | None  # speculative_config (None: plain decoding)
    k: int = 0
    tokens_per_second: float = 0.0
    speedup: float = 1.0  # over plain decoding on the same prompts, same run
    acceptance: float = 0.0
    tokens_per_step: float = 1.0
    draft_cost: float = 0.0  # drafting time per drafted token / plain decoding time per token
    memory_bytes: int = 0  # resident memory the candidate added when it was loaded
    mean_tokens: float = 0.0  # generated tokens per request
    batch: int = 1
    acceptance_by_position: list[float] = field(default_factory=list)


@dataclass
class Decision:
    name: str | None  # the chosen candidate (None: plain decoding)
    spec: dict | None  # its speculative_config with the chosen K (None: plain decoding)
    spec_max_batch: int | None  # drafting off above this batch size (None: on at every size measured)
    reasons: list[str]


def best_per_candidate(results: list[Measured]) -> dict[str, Measured]:
    """Each candidate's fastest configuration (over K and cut-offs) at batch 1."""
    best: dict[str, Measured] = {}
    for r in results:
        if r.spec is None or r.batch != 1:
            continue
        if r.name not in best or r.speedup > best[r.name].speedup:
            best[r.name] = r
    return best


def ranked(results: list[Measured]) -> list[Measured]:
    """Each candidate's fastest configuration at batch 1, fastest first."""
    return sorted(best_per_candidate(results).values(), key=lambda r: r.speedup, reverse=True)


def prior_max_batch(k: int) -> int:
    """The rule of thumb before measuring: verification is nearly free while batch x (K + 1) rows fit
    the rows one forward takes at the cost of one."""
    return max(1, VERIFY_ROWS // (k + 1))


def batch_cutoff(plain: dict[int, float], spec: dict[int, float]) -> int | None:
    """The largest batch size measured below the first where speculation no longer beats plain
    decoding (tokens/s over the batch); None when it wins at every size measured. 0: never wins."""
    sizes = sorted(set(plain) & set(spec))
    for i, b in enumerate(sizes):
        if spec[b] <= plain[b]:
            return sizes[i - 1] if i else 0
    return None


def decide(results: list[Measured], plain: dict[int, float] | None = None, spec: dict[int, float] | None = None,
           max_batch: int | None = None) -> Decision:
    """The recommendation and its reasons. ``plain``/``spec``: tokens/s by batch size for plain
    decoding and for the winner (the batch sweep; may be empty when the budget ran out)."""
    order = ranked(results)
    reasons: list[str] = []
    if not order:
        return Decision(None, None, None, ["no drafter could be measured: plain decoding"])
    win = order[0]
    mean_tokens = max((r.mean_tokens for r in results), default=0.0)
    if win.speedup < MIN_SPEEDUP:
        reasons.append(f"no drafter beats plain decoding by {MIN_SPEEDUP - 1:.0%} on these prompts (best: {win.name} "
                       f"{win.speedup:.2f}x): speculation off; put the effort into batching")
        return Decision(None, None, None, reasons + _drafter_notes(order))
    reasons.append(f"{win.name} at K={win.k}: {win.speedup:.2f}x over plain decoding at batch 1 "
                   f"({win.tokens_per_second:.1f} tok/s, acceptance {win.acceptance:.0%}, "
                   f"{win.tokens_per_step:.2f} tokens per target step, drafting costs {win.draft_cost:.2f} "
                   "of a plain step per token)")
    if len(order) > 1:
        runner_up = order[1]
        reasons.append(f"next best: {runner_up.name} {runner_up.speedup:.2f}x at K={runner_up.k}")
    reasons += _drafter_notes(order)
    if mean_tokens and mean_tokens < SHORT_ANSWER:
        reasons.append(f"answers are short (mean {mean_tokens:.0f} tokens): speculation saves little per request")
    if win.memory_bytes >= 1e6:
        reasons.append(f"memory: {win.name} adds {_size(win.memory_bytes)}")
    cutoff = batch_cutoff(plain or {}, spec or {})
    measured = sorted(set(plain or {}) & set(spec or {}))
    if cutoff == 0:
        reasons.append(f"at every batch size measured plain decoding is as fast ({_ratios(plain, spec)}): "
                       "speculation off")
        return Decision(None, None, None, reasons)
    if cutoff is not None:
        first_loss = next(b for b in measured if b > cutoff)
        reasons.append(f"at batch >= {first_loss} plain decoding is faster ({_ratios(plain, spec)}): "
                       f"spec_max_batch {cutoff}")
        smb: int | None = cutoff
    elif measured:
        reasons.append(f"speculation wins at every batch size measured ({_ratios(plain, spec)})")
        smb = None if max_batch is None or measured[-1] >= max_batch else measured[-1]
    else:
        smb = prior_max_batch(win.k)
        reasons.append(f"batch sizes not measured (budget): spec_max_batch {smb} from the rule of thumb "
                       f"(batch x (K+1) <= {VERIFY_ROWS} rows verify at about the cost of one)")
    return Decision(win.name, dict(win.spec or {}, num_speculative_tokens=win.k), smb, reasons)


def _drafter_notes(ranked: list[Measured]) -> list[str]:
    out = []
    for r in ranked:
        if (r.spec or {}).get("method") == "draft_model" and r.acceptance < LOW_ACCEPTANCE:
            out.append(f"{r.name}: acceptance {r.acceptance:.0%} < {LOW_ACCEPTANCE:.0%}: a draft fine-tuned on the "
                       "target's own outputs for prompts like these should accept more")
    return out


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _ratios(plain: dict[int, float] | None, spec: dict[int, float] | None) -> str:
    sizes = sorted(set(plain or {}) & set(spec or {}))
    return ", ".join(f"batch {b}: {spec[b] / plain[b]:.2f}x" for b in sizes if plain[b] > 0)
